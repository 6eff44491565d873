"""The chosen experts' up sections by the copy engine while the layer's expert kernel runs (issue 19, RAM regime).

Why (bench/NOTES.md, "Session 7, h28"): in the RAM regime the fused expert launch reads the pinned slab zero-copy
at ~86 % of H2D (~1,028 µs per MoE layer on the H200's super shape) where the copy engine moves the same bytes at
~98 % (the staged ups' copies: 1.44 MB in 28.7 µs). An expert's up section is read whole whatever the activations,
so it can go by DMA once the router has chosen; only the sparse down (the active 16-neuron groups) has to be read
by the kernel itself. So once the host has the layer's block addresses it plans, for the chosen experts whose ups
were not staged (at most a limit per layer, in top-k order), a slot of a VRAM ring and a flag value each (`plan`);
the kernel (one launch, kernels/expert_layer.py, `up_ready`) is launched on that plan, and right after it the
copies are queued on a copy stream, in batches (`issue`: ~3 µs of host time per copy, so off the path to the
launch). The kernel's programs go expert-major: the staged ones, the waiting ones in copy order, then those read
from the slab: a program whose up is still crossing spins on its batch's flag, the others
work, and the zero-copy down reads share the bus with the copies.

Ordering without events inside the graph: after a batch's up copies the same stream copies an 8-byte value (the
batch's epoch, unique, from a pinned ring of values the host writes before queuing) into the batch's flag in VRAM.
Copies on one stream run in order, so the flag holds the epoch only once the batch's rows are in VRAM; the kernel
reads the flag with acquire semantics. The flag copy is a copy-engine operation, not a kernel, so a grid whose
programs spin cannot starve it. The ring is rewritten for layer j+1 only after the host has waited for layer j+1's
router, which the compute stream runs after layer j's kernel (the ring's last reader), so no event is needed for
reuse. The slab slots copied from are pinned until the layer's kernel has run (the source defers them like any
layer's pins), and the kernel ends after every copy it waited for.
On the CPU (tests) the copies and flag writes are synchronous, before the kernel.

Measured (H200, run 1): a loss of 0.07-0.17 ms/token. Beside the kernel's zero-copy down reads the copy engine adds no
bandwidth (the kernel phase stays at ~84 % of H2D), and the pipeline's edges cost ~85 µs a layer. Off by default
(`MOESTREAM_UP_DMA=0`); its flags serve the non-blocking staging (gpu_worker/up_staging.py).
"""
from __future__ import annotations

import ctypes
import os

import torch

from gpu_worker.knobs import env_count, env_count_or_off, env_switch
from gpu_worker.up_staging import SLOT_ALIGN, STAGE_AFTERS, driver_memcpy_async

EPOCHS = 4096        # pinned flag values in flight at most (the host waits for every MoE layer's router: ~1)


def dma_limit_from_env() -> int:
    """MOESTREAM_UP_DMA: chosen-but-not-staged ups per layer moved by the copy engine (0: off, the zero-copy path)."""
    return env_count_or_off("MOESTREAM_UP_DMA", 0, "experts per layer")


def stage_extra_from_env() -> int:
    """MOESTREAM_STAGE_EXTRA: guessed ups staged beyond the adapted limit, non-blocking (gpu_worker/up_staging.py);
    3 by default (measured, bench/NOTES.md "Session 8"), 0: off."""
    return env_count_or_off("MOESTREAM_STAGE_EXTRA", 3, "guessed ups per layer")


def stage_batch_from_env() -> int:
    """MOESTREAM_STAGE_BATCH: staged ups per flag in non-blocking staging (gpu_worker/up_staging.py); 2 by default."""
    return env_count("MOESTREAM_STAGE_BATCH", 2, "staged ups per flag")


def stage_flag_from_env() -> str:
    """MOESTREAM_STAGE_FLAG: how a staged batch's flag is set, "write" (a stream memory write, the default since
    session 27's H100 A/B: −0.09 ms a token at 8 MoE layers, bench/NOTES.md) or "copy" (an 8-byte copy by the copy
    engine), gpu_worker/up_staging.py `flag_write`."""
    v = os.environ.get("MOESTREAM_STAGE_FLAG", "") or "write"
    if v not in ("copy", "write"):
        raise ValueError(f"MOESTREAM_STAGE_FLAG={v!r}: expected copy or write")
    return v


def stage_after_from_env() -> str:
    """MOESTREAM_STAGE_AFTER: how a stage's copies follow the expert kernel before them (gpu_worker/up_staging.py
    `after`, STAGE_AFTERS): "progress" (the default: the kernel releases them once MOESTREAM_STAGE_GATE_AT of its
    programs have ended), "value" (a stream memory write and wait after the kernel) or "event" (an event after it).
    Read per stage, so that one engine can A/B it (bench.e2e_stream --ab-env). Session 28's H100 A/B in one engine (8
    MoE layers, 4 rounds, 12 prompt pairs): progress −0.265 ms a token against event, lower in 12 of 12; value
    +0.035."""
    v = os.environ.get("MOESTREAM_STAGE_AFTER", "") or "progress"
    if v not in STAGE_AFTERS:
        raise ValueError(f"MOESTREAM_STAGE_AFTER={v!r}: expected one of {', '.join(STAGE_AFTERS)}")
    return v


def stage_gate_from_env() -> bool:
    """MOESTREAM_STAGE_GATE (1 by default; 0: off): the fused expert kernel of a staged layer counts its programs and
    can release the next stage's copies (kernels/expert_layer.py GATE), compiled into its graph whatever
    MOESTREAM_STAGE_AFTER says per stage, so that one engine can A/B the modes. Off: no count in the kernel (one atomic
    a program), and "progress" waits for the compute stream's write after the kernel, as "value" does. Read when
    the engine is made."""
    return env_count_or_off("MOESTREAM_STAGE_GATE", 1, "switch (1: on)") > 0


def stage_judge_after_from_env() -> bool:
    """MOESTREAM_STAGE_JUDGE_AFTER (0 by default; 1: on; read per stage, so one engine can A/B it): whether a layer's
    staged copies were done in time (the event query that adapts its next stage's size, `UpStaging.limit`) is asked
    after the layer's launch, when its taken ranks are counted, instead of inside the route before the launch. The
    query is the take's one CUDA call: 5 µs of the route's 12.5 µs take a MoE layer on an H100 host (bench/NOTES.md
    session 34 call 1). Asked later, a copy that ends in between counts as in time. Measured (H100, 8 MoE layers, one
    engine, 4 rounds, 12 pairs, session 34 call 7): the take 0.114-0.118 -> 0.091-0.096 ms a token, the route 0.22-0.24
    -> 0.20-0.21, the token level (+0.005 ms median, lower in 5 of 12): off."""
    return env_switch("MOESTREAM_STAGE_JUDGE_AFTER", False)


def stage_gate_at_from_env() -> float:
    """MOESTREAM_STAGE_GATE_AT: with MOESTREAM_STAGE_AFTER=progress, the share of the expert kernel's programs that
    have ended when the next layer's staged copies may start (above 0, at most 1; 0.9 by default). Read per stage."""
    v = os.environ.get("MOESTREAM_STAGE_GATE_AT", "") or "0.9"
    try:
        p = float(v)
    except ValueError:
        raise ValueError(f"MOESTREAM_STAGE_GATE_AT={v!r}: a share of the kernel's programs, above 0, at most "
                         "1") from None
    if not 0.0 < p <= 1.0:
        raise ValueError(f"MOESTREAM_STAGE_GATE_AT={p}: must be above 0 and at most 1")
    return p


def stage_min_precision_from_env() -> float:
    """MOESTREAM_STAGE_MIN_PRECISION: the non-blocking extras (`MOESTREAM_STAGE_EXTRA`) stop at the first rank whose
    guesses were read less often than this share of the times they were staged (gpu_worker/up_staging.py
    `how_many`). 0.5 by default (H200 session 18: RAM regime 5.744 / 5.617 -> 5.596 / 5.587 ms/token in two rounds,
    wrong guesses 25.1 / 22.4 -> 18.5 / 18.2 MB a token); 0: every extra is staged."""
    v = os.environ.get("MOESTREAM_STAGE_MIN_PRECISION", "0.5")
    try:
        p = float(v)
    except ValueError:
        raise ValueError(f"MOESTREAM_STAGE_MIN_PRECISION={v!r}: a share of staged guesses read, 0 to 1") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"MOESTREAM_STAGE_MIN_PRECISION={p}: must be within 0 and 1")
    return p


class ChosenUpDMA:
    def __init__(self, k: int, up_bytes: int, device, batch: int = 2):
        """k: the router's top-k (ring slots, one per position); up_bytes: the bytes copied per expert; batch:
        experts per flag (a flag copy is ~1-2 µs of copy-engine time: fewer flags, coarser overlap)."""
        if k < 1 or up_bytes < 1 or batch < 1:
            raise ValueError(f"up DMA needs slots, bytes and a batch, got k={k}, {up_bytes} bytes, batch {batch}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.k, self.up_bytes, self.batch = k, up_bytes, batch
        stride = -(-up_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.buf = torch.zeros(k, stride, dtype=torch.uint8, device=self.device)
        self._address = [self.buf[i].data_ptr() for i in range(k)]
        # one per batch, by its first slot; flags[k]: programs that gave up waiting (kernels/expert_layer.py)
        self.flags = torch.zeros(k + 1, dtype=torch.int64, device=self.device)
        self._epochs = torch.zeros(EPOCHS, dtype=torch.int64, pin_memory=self.cuda)
        self._epochs_np = self._epochs.numpy()
        self.epoch = 0
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._memcpy = driver_memcpy_async() if self.cuda else None
        if self.cuda and self._memcpy is None:
            raise RuntimeError("the chosen ups' DMA needs libcuda's cuMemcpyAsync (the flags are copies, not kernels)")
        if self.cuda:       # the ring's and the flags' zeroing ran on the compute stream: the first copies follow it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.copied = 0          # ups moved this way (the accounting)

    def gave_up(self) -> int:
        """Programs that stopped waiting for a flag that never came (a sync; read with the other counters)."""
        return int(self.flags[self.k])

    def plan(self, positions: list[int], k: int | None = None, first: list[int] = ()) -> tuple:
        """The ring slots and flags of the top-k `positions` whose ups are to cross, in batches (nothing is
        queued yet: `issue` does that, after the kernel is launched). Returns (up address or 0, epoch to wait for
        or 0, flag index, launch order) per position of the top-k: the kernel's `up_addrs` for `positions` and its
        waits. Launch order: `first` (e.g. the staged ones), then `positions` in copy order, then the rest (read from
        the slab: their programs keep the bus busy after the last copy, where DMA'd experts last left only their
        downs to read — run 1, bench/NOTES.md "Session 7, h28")."""
        k = self.k if k is None else k
        ups, want, flag = [0] * k, [0] * k, [0] * k
        for b0 in range(0, len(positions), self.batch):
            batch = positions[b0:b0 + self.batch]
            self.epoch += 1
            for p in batch:
                ups[p], want[p], flag[p] = self._address[p], self.epoch, batch[0]
        waiting = set(positions)
        head = [p for p in first if p not in waiting]
        rest = [p for p in range(k) if p not in waiting and p not in set(head)]
        return ups, want, flag, head + list(positions) + rest

    def issue(self, positions: list[int], sources: list[int], want: list[int]) -> None:
        """Queue the planned copies of the up sections at `sources` (addresses in the registered slab; on the CPU
        plain host addresses, copied at once) into the positions' ring slots, each batch followed by its flag."""
        ub = self.up_bytes
        for b0 in range(0, len(positions), self.batch):
            batch = positions[b0:b0 + self.batch]
            for n, p in enumerate(batch):
                if self.cuda:
                    rc = self._memcpy(self._address[p], sources[b0 + n], ub, self.stream.cuda_stream)
                    if rc:
                        raise RuntimeError(f"cuMemcpyAsync of a chosen up section failed: CUDA error {rc}")
                else:
                    ctypes.memmove(self._address[p], sources[b0 + n], ub)
            e, fi = want[batch[0]], batch[0]
            if self.cuda:
                slot = e % EPOCHS
                self._epochs_np[slot] = e
                rc = self._memcpy(self.flags[fi].data_ptr(), self._epochs[slot].data_ptr(), 8, self.stream.cuda_stream)
                if rc:
                    raise RuntimeError(f"cuMemcpyAsync of an up batch's flag failed: CUDA error {rc}")
            else:
                self.flags[fi] = e
        self.copied += len(positions)

    def copy(self, positions: list[int], sources: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """`plan` and `issue` at once (the copies queued before the kernel: tests, the CPU)."""
        got = self.plan(positions)
        self.issue(positions, sources, got[1])
        return got
