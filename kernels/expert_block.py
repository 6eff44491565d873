"""One routed expert's block, as `docs/block-layout.md` fixes it: geometry, a packer, and section views.

The kernels read blocks through these offsets; the packer exists for tests and benchmarks (the store's
own writer lives in `io_workers/`). Written from the layout document alone, so a test that compares
`pack_expert_block` + the twins against the checkpoint tensors tests the document, not this file.
"""
from __future__ import annotations

from dataclasses import dataclass


SECTION_ALIGN = 256
BLOCK_ALIGN = 4096
GROUP = 16  # neurons per down group = values per NVFP4 scale


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ExpertGeometry:
    """Byte offsets of one expert block. L = latent (input) width, I = intermediate width."""
    L: int
    I: int
    fmt: str = "nvfp4"  # 'nvfp4' | 'fp8' | 'bf16'

    def __post_init__(self):
        if self.fmt not in ("nvfp4", "fp8", "bf16"):
            raise ValueError(f"unknown expert format {self.fmt!r}")
        if self.L % GROUP or self.I % GROUP:
            raise ValueError(f"L={self.L} and I={self.I} must be multiples of {GROUP}")

    @property
    def value_bytes(self) -> float:
        return {"nvfp4": 0.5, "fp8": 1, "bf16": 2}[self.fmt]

    @property
    def up_values_bytes(self) -> int:
        return int(self.I * self.L * self.value_bytes)

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
        return self.I // GROUP

    @property
    def group_bytes(self) -> int:
        """One 16-neuron down group: values [L, 16 values] then (NVFP4) scales [L]; 9·L bytes for NVFP4."""
        if self.fmt == "nvfp4":
            return 9 * self.L
        return int(self.L * GROUP * self.value_bytes)

    @property
    def block_bytes(self) -> int:
        return self.down_off + self.n_groups * self.group_bytes

    @property
    def block_stride(self) -> int:
        return _round_up(self.block_bytes, BLOCK_ALIGN)

    @property
    def up_bytes(self) -> int:
        """Bytes of the up projection (values + scales) as laid in the block, padding excluded."""
        return self.up_values_bytes + self.up_scales_bytes


SUPER = ExpertGeometry(L=1024, I=2688, fmt="nvfp4")


def pack_expert_block(geom: ExpertGeometry, up_w, up_s, down_w, down_s) -> "torch.Tensor":
    """Checkpoint tensors -> one block (U8 [block_stride]).

    NVFP4: up_w U8 [I, L/2], up_s e4m3 [I, L/16], down_w U8 [L, I/2], down_s e4m3 [L, I/16].
    FP8 / BF16: up_w [I, L], down_w [L, I] in the stored dtype; scales None.
    """
    import torch   # lazily: the geometry above is pure arithmetic that torch-free processes import too
    L, I = geom.L, geom.I
    blk = torch.zeros(geom.block_stride, dtype=torch.uint8)
    raw = lambda t: t.contiguous().view(torch.uint8).reshape(-1)  # noqa: E731
    u = raw(up_w)
    blk[: u.numel()] = u
    if geom.fmt == "nvfp4":
        s = raw(up_s)
        blk[geom.up_scales_off: geom.up_scales_off + s.numel()] = s
        dv = down_w.contiguous().view(torch.uint8).reshape(L, geom.n_groups, 8).permute(1, 0, 2)  # [G, L, 8]
        ds = down_s.contiguous().view(torch.uint8).reshape(L, geom.n_groups).t()                  # [G, L]
        groups = torch.cat((dv.reshape(geom.n_groups, 8 * L), ds), dim=1)                          # [G, 9L]
    else:
        esz = down_w.element_size()
        dv = down_w.contiguous().reshape(L, geom.n_groups, GROUP).permute(1, 0, 2).contiguous()    # [G, L, 16]
        groups = dv.view(torch.uint8).reshape(geom.n_groups, L * GROUP * esz)
    g = groups.reshape(-1)
    blk[geom.down_off: geom.down_off + g.numel()] = g
    return blk


def block_sections(geom: ExpertGeometry, blk):
    """Views of one block's sections (no copies): (up_values, up_scales|None, down_values, down_scales|None).

    down_values [G, L, 8] U8 (NVFP4) or [G, L, 16] stored dtype; down_scales [G, L] e4m3.
    """
    import torch
    L, I, G = geom.L, geom.I, geom.n_groups
    if geom.fmt == "nvfp4":
        up_v = blk[: geom.up_values_bytes].view(I, L // 2)
        up_s = blk[geom.up_scales_off: geom.up_scales_off + geom.up_scales_bytes].view(I, L // GROUP)
        grp = blk[geom.down_off: geom.down_off + G * geom.group_bytes].view(G, 9 * L)
        dv = grp[:, : 8 * L].reshape(G, L, 8)
        ds = grp[:, 8 * L:]
        return up_v, up_s.view(torch.float8_e4m3fn), dv, ds.view(torch.float8_e4m3fn)
    dt = torch.float8_e4m3fn if geom.fmt == "fp8" else torch.bfloat16
    up_v = blk[: geom.up_values_bytes].view(dt).view(I, L)
    grp = blk[geom.down_off: geom.down_off + G * geom.group_bytes].view(dt).view(G, L, GROUP)
    return up_v, None, grp, None
