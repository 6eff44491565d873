"""Weights that live in pinned host memory and stream to the device stage by stage (the vision tower).

A model pass uses its weights as a fixed sequence of *stages* (dicts of tensors, e.g. one ViT block each).
`StreamedWeights` packs every stage into one host buffer (pinned on CUDA, so copies run at the bus's speed and
asynchronously) and keeps two device slots, each as large as the largest stage. `get(i)` hands out views of
stage i in a slot and, in the same call, starts copying stage i+1 (after the last stage: stage 0, ready for the
next pass) into the other slot on a copy stream, so the copy overlaps stage i's compute.

Contract with the caller, which is what makes two slots enough: once `get(i + 1)` is called, the caller
enqueues no more work that reads stage i's tensors. The slot stage i occupied is refilled only after every
kernel enqueued on the compute stream before that call has run (an event orders it on the device, the host
does not wait). On the CPU the same code runs with synchronous copies into the slots, so tests exercise the
packing and the slot rotation.
"""
from __future__ import annotations

import torch

ALIGN = 256       # each tensor starts on a 256-byte boundary in the buffer and in the slot


class StreamedWeights:
    def __init__(self, stages: list[dict[str, torch.Tensor]], device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layout: list[list[tuple[str, int, torch.Size, torch.dtype]]] = []
        self.offset: list[int] = []
        self.nbytes: list[int] = []
        total = 0
        for s in stages:
            entries, o = [], 0
            for name, t in s.items():
                entries.append((name, o, t.shape, t.dtype))
                o += -(-t.nbytes // ALIGN) * ALIGN
            self.layout.append(entries)
            self.offset.append(total)
            self.nbytes.append(o)
            total += o
        self.slot_bytes = max(self.nbytes)
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda)
        for s, entries, base in zip(stages, self.layout, self.offset):
            for name, o, shape, dtype in entries:
                t = s[name].contiguous()
                self.host[base + o:base + o + t.nbytes].copy_(t.view(-1).view(torch.uint8))
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.held = [None, None]             # stage index in each slot (loaded or being loaded)
        self.ready = [None, None]            # CUDA event: the slot's copy has landed
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.last_slot = 1
        self.bytes_copied = 0

    def __len__(self) -> int:
        return len(self.layout)

    @property
    def host_bytes(self) -> int:
        return self.host.numel()

    @property
    def device_bytes(self) -> int:
        return 2 * self.slot_bytes

    def _load(self, i: int, slot: int, free) -> None:
        n, base = self.nbytes[i], self.offset[i]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(free)          # the slot's previous readers have run
                self.slots[slot][:n].copy_(self.host[base:base + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
            self.ready[slot] = ev
        else:
            self.slots[slot][:n].copy_(self.host[base:base + n])
        self.held[slot] = i
        self.bytes_copied += n

    def get(self, i: int) -> dict[str, torch.Tensor]:
        """Stage i on the device (views into a slot), valid until the next `get`'s caller work is enqueued."""
        free = None
        if self.cuda:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))   # after every kernel using earlier stages
        if i in self.held:
            slot = self.held.index(i)
        else:
            slot = 1 - self.last_slot
            self._load(i, slot, free)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        nxt = (i + 1) % len(self.layout)
        if self.held[1 - slot] != nxt:
            self._load(nxt, 1 - slot, free)
        self.last_slot = slot
        buf = self.slots[slot]
        return {name: buf[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for name, o, shape, dtype in self.layout[i]}
