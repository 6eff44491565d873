"""One routed expert's block, as `docs/block-layout.md` fixes it: the geometry, section views, and an oracle packer.

`ExpertGeometry` is the one geometry type of the project: the store writes and reads blocks with it (its
manifest records `to_dict()`), the cache sizes slots with it, and the kernels read blocks through its
offsets. It lives here, in the lowest library, because the kernels need it and `kernels` imports nothing
of ours; it is pure arithmetic, so a process without torch (the store reader, the IO workers) imports it
too. torch is imported only inside the functions that build views or pack.

`pack_expert_block` is written from the layout document alone, independently of the store's writer
(`expert_store.layout.pack_block`): a test that compares it, the store's packer and the twins against the
checkpoint tensors tests the document, not either packer.
"""
from __future__ import annotations

from dataclasses import dataclass


SECTION_ALIGN = 256
BLOCK_ALIGN = 4096  # block stride alignment: O_DIRECT needs offsets and lengths in whole pages
GROUP = 16  # neurons per NVFP4 scale (and per down group unless the store splits them)
FORMATS = ("nvfp4", "fp8", "bf16")
DOWN_GROUP_NEURONS = (16, 8, 4, 2, 1)  # sub-group sizes a store may split each 16-neuron down group into
# bytes per weight element, as a fraction (num, den): nvfp4 packs two 4-bit codes per byte
_ELEM_BYTES = {"nvfp4": (1, 2), "fp8": (1, 1), "bf16": (2, 1)}


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ExpertGeometry:
    """Byte offsets of one expert block. L = latent (input) width, I = intermediate width.

    down_group_neurons n: the down section is stored in groups of n consecutive neurons (default 16, the
    NVFP4 scale block). A smaller n splits each 16-neuron group into 16/n sub-groups that each carry a copy
    of the group's scales, so a sub-group with no active neuron is never read (docs/block-layout.md).
    `n_groups` and `group_bytes` are those of the stored (sub-)groups; `n_scale_groups` is I/16.
    """
    L: int
    I: int
    fmt: str = "nvfp4"  # 'nvfp4' | 'fp8' | 'bf16' (the manifest calls it the block "kind")
    down_group_neurons: int = GROUP

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown block kind {self.fmt!r} (known: {', '.join(FORMATS)})")
        if self.L <= 0 or self.I <= 0 or self.L % GROUP or self.I % GROUP:
            raise ValueError(f"expert shape L={self.L}, I={self.I}: both must be positive multiples of {GROUP}")
        if self.down_group_neurons not in DOWN_GROUP_NEURONS:
            raise ValueError(f"down_group_neurons={self.down_group_neurons!r}: must be one of "
                             f"{', '.join(map(str, DOWN_GROUP_NEURONS))}")

    @property
    def up_values_bytes(self) -> int:
        num, den = _ELEM_BYTES[self.fmt]
        return self.I * self.L * num // den

    @property
    def up_scales_off(self) -> int:
        return _round_up(self.up_values_bytes, SECTION_ALIGN)

    @property
    def up_scales_bytes(self) -> int:
        return self.I * self.L // GROUP if self.fmt == "nvfp4" else 0

    @property
    def down_off(self) -> int:
        return _round_up(self.up_scales_off + self.up_scales_bytes, SECTION_ALIGN)

    @property
    def n_groups(self) -> int:
        """Down groups as stored: I / down_group_neurons."""
        return self.I // self.down_group_neurons

    @property
    def n_scale_groups(self) -> int:
        """16-neuron groups (one NVFP4 scale per row each): the granularity of the ReLU² group mask."""
        return self.I // GROUP

    @property
    def group_row_value_bytes(self) -> int | None:
        """Bytes of one output row's values inside a down group: n/2 (nvfp4), n (fp8), 2n (bf16); None for
        nvfp4 groups of one neuron, whose codes are packed two rows to a byte."""
        num, den = _ELEM_BYTES[self.fmt]
        n = self.down_group_neurons * num
        return n // den if n % den == 0 else None

    @property
    def group_value_bytes(self) -> int:
        num, den = _ELEM_BYTES[self.fmt]
        return self.L * self.down_group_neurons * num // den

    @property
    def group_scale_bytes(self) -> int:
        return self.L if self.fmt == "nvfp4" else 0

    @property
    def group_bytes(self) -> int:
        """One stored down group: values [L, n values] then (NVFP4) scales [L]; 9·L bytes for 16 NVFP4 neurons."""
        return self.group_value_bytes + self.group_scale_bytes

    @property
    def block_bytes(self) -> int:
        return self.down_off + self.n_groups * self.group_bytes

    @property
    def block_stride(self) -> int:
        return _round_up(self.block_bytes, BLOCK_ALIGN)

    @property
    def pages(self) -> int:
        return self.block_stride // BLOCK_ALIGN

    @property
    def up_bytes(self) -> int:
        """Bytes of the up projection (values + scales) as laid in the block, padding excluded."""
        return self.up_values_bytes + self.up_scales_bytes

    # ------------------------------------------------------------------ sections (the store's view)
    @property
    def up_values(self) -> Section:
        return Section("up_values", 0, self.up_values_bytes)

    @property
    def up_scales(self) -> Section:
        return Section("up_scales", self.up_scales_off, self.up_scales_bytes)

    @property
    def down_groups(self) -> Section:
        return Section("down_groups", self.down_off, self.n_groups * self.group_bytes)

    def sections(self) -> tuple[Section, Section, Section]:
        return (self.up_values, self.up_scales, self.down_groups)

    def section_at(self, byte: int) -> str:
        for s in self.sections():
            if s.offset <= byte < s.end:
                return s.name
        return "padding"

    def raw_shapes(self) -> dict[str, tuple[int, int] | None]:
        """Shapes of the four checkpoint tensors as raw bytes (U8 views): up/down weight, up/down scale."""
        num, den = _ELEM_BYTES[self.fmt]
        L, I = self.L, self.I
        q = self.fmt == "nvfp4"
        return {
            "up_weight": (I, L * num // den), "up_scale": (I, L // GROUP) if q else None,
            "down_weight": (L, I * num // den), "down_scale": (L, I // GROUP) if q else None,
        }

    def to_dict(self) -> dict:
        """The manifest's record of the geometry: the inputs and every derived size, so a reader whose
        arithmetic differs refuses the store instead of misreading it."""
        return {
            "kind": self.fmt, "L": self.L, "I": self.I,
            "sections": {s.name: {"offset": s.offset, "bytes": s.nbytes} for s in self.sections()},
            "group_bytes": self.group_bytes, "group_value_bytes": self.group_value_bytes,
            "group_scale_bytes": self.group_scale_bytes,
            "block_bytes": self.block_bytes, "block_stride": self.block_stride,
            "down_group_neurons": self.down_group_neurons,
        }


SUPER = ExpertGeometry(L=1024, I=2688, fmt="nvfp4")


def block_views(geom: ExpertGeometry, blk) -> dict:
    """Views (no copies) of one block's parts in `blk`, a torch U8 tensor of at least block_bytes.
    G = n_groups = I/n down groups of n = down_group_neurons neurons (16 unless the store splits them).

    nvfp4: up_values U8 [I, L/2], up_scales e4m3 [I, L/16], down_groups U8 [G, group_bytes],
           down_values U8 [G, L, n/2] (n = 1: [G, L/2], rows 2r and 2r+1 in one byte, low nibble first),
           down_scales e4m3 [G, L] (strided views into down_groups; sub-groups of one 16-group hold copies).
    fp8 / bf16: up_values [I, L], down_groups U8 [G, group_bytes], down_values [G, L, n] in the
           stored dtype; up_scales and down_scales are None.
    """
    import torch   # lazily: the geometry above is pure arithmetic that torch-free processes import too
    L, I, G = geom.L, geom.I, geom.n_groups
    groups = blk[geom.down_off: geom.down_off + G * geom.group_bytes].view(G, geom.group_bytes)
    if geom.fmt == "nvfp4":
        return {
            "up_values": blk[: geom.up_values_bytes].view(I, L // 2),
            "up_scales": blk[geom.up_scales_off: geom.up_scales_off + geom.up_scales_bytes]
            .view(torch.float8_e4m3fn).view(I, L // GROUP),
            "down_groups": groups,
            "down_values": groups[:, : geom.group_value_bytes].view(G, L, geom.group_row_value_bytes)
            if geom.group_row_value_bytes else groups[:, : geom.group_value_bytes],
            "down_scales": groups[:, geom.group_value_bytes:].view(torch.float8_e4m3fn),
        }
    dt = torch.float8_e4m3fn if geom.fmt == "fp8" else torch.bfloat16
    return {
        "up_values": blk[: geom.up_values_bytes].view(dt).view(I, L),
        "up_scales": None,
        "down_groups": groups,
        "down_values": groups.view(dt).view(G, L, geom.down_group_neurons),
        "down_scales": None,
    }


def block_sections(geom: ExpertGeometry, blk):
    """The kernels' tuple form of `block_views`: (up_values, up_scales|None, down_values, down_scales|None)."""
    v = block_views(geom, blk)
    return v["up_values"], v["up_scales"], v["down_values"], v["down_scales"]


def pack_expert_block(geom: ExpertGeometry, up_w, up_s, down_w, down_s) -> "torch.Tensor":
    """Checkpoint tensors -> one block (U8 [block_stride]).

    NVFP4: up_w U8 [I, L/2], up_s e4m3 [I, L/16], down_w U8 [L, I/2], down_s e4m3 [L, I/16].
    FP8 / BF16: up_w [I, L], down_w [L, I] in the stored dtype; scales None.
    Down groups of n neurons, from the document: group s holds, row by row, neurons n·s … n·s+n−1 (NVFP4:
    as 4-bit codes, two to a byte, low nibble first, continuing across rows), then the rows' scales of the
    16-neuron group that holds them.
    """
    import torch
    L, I, n, G = geom.L, geom.I, geom.down_group_neurons, geom.n_groups
    blk = torch.zeros(geom.block_stride, dtype=torch.uint8)
    raw = lambda t: t.contiguous().view(torch.uint8).reshape(-1)  # noqa: E731
    u = raw(up_w)
    blk[: u.numel()] = u
    if geom.fmt == "nvfp4":
        s = raw(up_s)
        blk[geom.up_scales_off: geom.up_scales_off + s.numel()] = s
        b = down_w.contiguous().view(torch.uint8)
        codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(L, I)                               # [L, I]
        codes = codes.reshape(L, G, n).permute(1, 0, 2).reshape(G, L * n)                         # [G, L·n]
        dv = codes[:, 0::2] | (codes[:, 1::2] << 4)                                                # [G, L·n/2]
        ds = down_s.contiguous().view(torch.uint8).t().repeat_interleave(GROUP // n, dim=0)       # [G, L]
        groups = torch.cat((dv, ds), dim=1)
    else:
        esz = down_w.element_size()
        dv = down_w.contiguous().reshape(L, G, n).permute(1, 0, 2).contiguous()                   # [G, L, n]
        groups = dv.view(torch.uint8).reshape(G, L * n * esz)
    g = groups.reshape(-1)
    blk[geom.down_off: geom.down_off + g.numel()] = g
    return blk
