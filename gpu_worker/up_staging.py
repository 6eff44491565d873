"""The up sections of the experts that the router guessed for the next MoE layer, copied into VRAM while the
dense layers run.

Why (bench/NOTES.md, "Early ups"): in the RAM regime a decode token moved its expert bytes over PCIe only while
the expert kernel of a MoE layer ran. During the dense stretch after it (the combine, the Mamba layer, the next
router and latent projection: ~0.6 ms per MoE layer on the H200's super shape) the bus sat idle. The next layer's
experts are known only after its router, but the router of layer j also guesses layer j+1's choice (the next
router applied to this layer's input), right for most of them. An expert's up section (values and scales, the
first `down_off` bytes of its block) is read whole by the kernel, unlike the down groups, which depend on the
activations. So it can cross early: as soon as layer j's expert kernel is done, the copy engine moves the
guessed ups of layer j+1 from the pinned slab into this buffer, while the GPU computes the dense layers. Layer
j+1's kernel then reads the staged ups from VRAM and only the rest over the bus.

Ordering, with one buffer: the copies for layer j+1 wait for an event recorded after layer j's expert kernel
(the buffer's last reader); layer j+1's kernel waits for the copies' event. The slab slots copied from stay
pinned until the copies are known to be done, so the cache cannot hand them to an IO worker mid-copy.
On the CPU (tests) the copies are synchronous and nothing waits.
"""
from __future__ import annotations

import torch

SLOT_ALIGN = 256    # the kernel's 16-byte vector loads want aligned sections


class UpStaging:
    def __init__(self, n_slots: int, up_bytes: int, device):
        """n_slots: experts staged per layer at most (the router's top-k); up_bytes: the bytes copied per expert
        (the block's first `down_off` bytes: up values, their scales and the padding between)."""
        if n_slots < 1 or up_bytes < 1:
            raise ValueError(f"up staging needs slots and bytes, got {n_slots} slots of {up_bytes} bytes")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.up_bytes = up_bytes
        stride = -(-up_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.buf = torch.empty(n_slots, stride, dtype=torch.uint8, device=self.device)
        self._address = [self.buf[i].data_ptr() for i in range(n_slots)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.layer: int | None = None        # the MoE layer whose guessed ups the buffer holds
        self.slot_of: dict[int, int] = {}    # expert -> buffer slot
        self.done = None                     # event after the copies (CUDA)
        self._waited = True                  # the compute stream already waits for `done`
        self._held: list[tuple[object, list[int]]] = []   # (copies' event, slab slots pinned for them)
        self.staged = 0                      # ups copied (each crossed the bus once)
        self.used = 0                        # staged ups a kernel read

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def stage(self, layer: int, experts: list[int], sources: list[torch.Tensor], slots: list[int]) -> None:
        """Copy the up sections of `experts` (sources: their blocks in the slab, U8 views) into the buffer, after
        the work queued so far on the current stream (the kernel that last read the buffer). `slots`: the slab
        slots pinned for the copies; they come back from `releasable` once the copies are done."""
        n = min(len(experts), len(self._address))
        experts, sources = experts[:n], sources[:n]
        ub = self.up_bytes
        if self.cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(after)
            with torch.cuda.stream(self.stream):
                for i, src in enumerate(sources):
                    self.buf[i, :ub].copy_(src[:ub], non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        else:
            for i, src in enumerate(sources):
                self.buf[i, :ub].copy_(src[:ub])
        self._waited = False
        self.layer = layer
        self.slot_of = {e: i for i, e in enumerate(experts)}
        self.staged += n
        self._held.append((self.done, list(slots)))

    def take(self, layer: int, experts: list[int]) -> dict[int, int]:
        """{expert: address of its staged up section} for those of `experts` staged for `layer` (consumed: a
        later stage overwrites them). When any is used, the current stream waits for the copies first."""
        if self.layer != layer or not self.slot_of:
            return {}
        got = {e: self._address[self.slot_of[e]] for e in experts if e in self.slot_of}
        self.layer, self.slot_of = None, {}
        if got:
            self.used += len(got)
            if self.cuda and not self._waited:
                torch.cuda.current_stream(self.device).wait_event(self.done)
                self._waited = True
        return got

    def releasable(self, wait: bool = False) -> list[int]:
        """Slab slots whose copies are done (wait: all of them, waiting for the copies where they still run)."""
        out, keep = [], []
        for ev, slots in self._held:
            if ev is not None and wait:
                ev.synchronize()
            if ev is None or ev.query():
                out.extend(slots)
            else:
                keep.append((ev, slots))
        self._held = keep
        return out
