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

How many: a staged up is free where it crosses while the bus would idle, and costs bus time where it does not
(a used one saves its bytes at the kernel's ~86 % of H2D, so past the idle window only guesses right > 86 % of
the time would pay). Each MoE layer keeps its own limit on the copies, in the router's rank order (its top-k is
sorted by score, the likeliest first): when the copies were done by the time the layer's kernel needed them the
limit grows by one, when they were not (the kernel waits) it shrinks by one. It settles at what the layer's dense
stretch hides.

The copies are issued with the driver's cuMemcpyAsync through ctypes (~3 µs each on the host; a torch copy_ of
a slab view cost ~20 µs, measured on the H200 host: 2.1 ms per token of host time for 4 MoE layers), falling back
to torch where libcuda cannot be loaded.

Ordering, with one buffer: the copies for layer j+1 wait for an event recorded after layer j's expert kernel
(the buffer's last reader); layer j+1's kernel waits for the copies' event. The slab slots copied from stay
pinned until the copies are known to be done, so the cache cannot hand them to an IO worker mid-copy.
On the CPU (tests, bench.host_bookkeeping) the copies are synchronous (a memmove per section) and nothing waits.

Non-blocking mode (`extra` > 0; `MOESTREAM_STAGE_EXTRA`, 3 by default since session 8's H200 run): `extra` more
guesses than the limit, each batch of copies followed by a fresh epoch written into the batch's flag (a stream
memory write by default, or an 8-byte copy as gpu_worker/up_dma.py's mechanism: `flag_write`), and
`take(blocking=False)` leaves the compute stream alone: the kernel's programs of each staged expert wait for its flag
(kernels/expert_layer.py `up_ready`), so copies that overrun the dense stretch delay only their own experts, not the
layer. The limit is judged on the first `limit` copies (an event after them),
as in blocking mode.
"""
from __future__ import annotations

import ctypes
from itertools import repeat

import torch

from gpu_worker.copy_pins import CopyPins

EPOCHS = 4096       # pinned flag values in flight at most (the host waits for every MoE layer's router)
FLAG_ROOM = 512     # a top-k up to n_slots + this (the kernel's give-up counter sits at flags[k])

SLOT_ALIGN = 256    # the kernel's 16-byte vector loads want aligned sections
PRECISION_SAMPLES = 32      # copies of a rank before its share read gates the extras (`min_precision`)
_DRIVER = []        # [cuMemcpyAsync or None], loaded once
_WRITE = []         # [cuStreamWriteValue64 or None], loaded once
_WAIT = []          # [cuStreamWaitValue64 or None], loaded once
WAIT_VALUE_GEQ = 0  # cuStreamWaitValue64's flags: wait until the word >= the value
# how a stage's copies follow the compute stream's work before them (`UpStaging.after`): "event", an event recorded on
# the compute stream that the staging stream waits for; "value", a stream memory write of a fresh epoch on the compute
# stream and a stream memory wait for it (>=) on the staging stream (no event); "progress", the same wait, for an epoch
# that the last expert kernel itself writes once `gate_at` of its programs have ended (kernels/expert_layer.py GATE),
# the compute stream's write after the kernel only a fallback, into the other of two buffers (the kernel still reads
# the one staged for it)
STAGE_AFTERS = ("event", "value", "progress")


def host_memcpy(dst: int, src: int, nbytes: int, stream=None) -> int:
    """The CPU's stand-in for cuMemcpyAsync (same arguments, 0 for success): one C call per copy, as on the GPU host
    (torch views and `copy_` per section cost the CPU bench ~300-440 µs a layer, where the GPU host makes ~25 calls)."""
    ctypes.memmove(dst, src, nbytes)
    return 0


def _libcuda_function(cache: list, names: tuple[str, ...], argtypes: list):
    """The first of `names` that libcuda exports, typed (argtypes, int result), or None where libcuda or every name is
    missing; looked up once into `cache` (a one-element list)."""
    if not cache:
        f = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in names:
                f = getattr(lib, name, None)
                if f is not None:
                    f.argtypes = argtypes
                    f.restype = ctypes.c_int
                    break
        except OSError:
            f = None
        cache.append(f)
    return cache[0]


def driver_memcpy_async():
    """libcuda's cuMemcpyAsync(dst, src, bytes, stream) (unified addresses), or None where it cannot be loaded."""
    return _libcuda_function(_DRIVER, ("cuMemcpyAsync",),
                             [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p])


def driver_write_value64():
    """libcuda's cuStreamWriteValue64(stream, device address, value, flags) (the `_v2` entry point where the driver has
    it), or None where it cannot be loaded. A stream memory operation: the stream's front end writes the value once
    the work before it on the stream is done, with a memory fence before the write (flags 0), no copy engine."""
    return _libcuda_function(_WRITE, ("cuStreamWriteValue64_v2", "cuStreamWriteValue64"),
                             [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint])


def driver_wait_value64():
    """libcuda's cuStreamWaitValue64(stream, device address, value, flags), or None where it cannot be loaded: the
    stream's later work waits until the 64-bit word compares to the value as flags say (WAIT_VALUE_GEQ, 0: >=)."""
    return _libcuda_function(_WAIT, ("cuStreamWaitValue64_v2", "cuStreamWaitValue64"),
                             [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint])


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
        self._bufs = [self.buf]              # "progress" adds a second buffer, and the stages alternate
        self._addresses = [self._address]
        self._current = 0
        self._wait_slot = [(0, 0)] * n_slots       # slot -> (epoch, flag index) of its last batch
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._after = torch.cuda.Event() if self.cuda else None     # re-recorded per stage: the buffer's last reader
        # how the copies follow the buffer's last reader (STAGE_AFTERS; the engine sets MOESTREAM_STAGE_AFTER's per
        # stage). Session 27's decode timeline: 16-19 µs from the expert kernel's end to the first staged copy
        self.after = "event"
        self.gate_at = 0.9                   # "progress": the share of the kernel's programs ended before the copies
        # [counter, word]: the kernel's ended programs, and the epoch the staging stream waits for (`launch_gate`)
        self.gate = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._gate_epoch = 0
        self._wait = None                    # cuStreamWaitValue64, loaded at the first "value" or "progress"
        # copies by address: the driver's on CUDA, a memmove on the CPU (views only where the driver is missing)
        self._memcpy = driver_memcpy_async() if self.cuda else host_memcpy
        self.limit: dict[int, int] = {}      # MoE layer -> copies to issue (adapted to its dense stretch)
        self._used_by_rank = [0] * n_slots   # how often the guess of each rank was read (`used_by_rank`)
        self._taken = None                   # (slot_of, experts) of the last take, its ranks not yet counted
        self._judge = None                   # (layer, event, copies) of the last take's stage, not yet judged
        self.judge_after = False             # judged after the launch (`stage_judge_after_from_env`, set per stage)
        self.staged_by_rank = [0] * n_slots
        self.layer: int | None = None        # the MoE layer whose guessed ups the buffer holds
        self.slot_of: dict[int, int] = {}    # expert -> buffer slot
        self.done = None                     # event after the copies (CUDA)
        self._waited = True                  # the compute stream already waits for `done`
        self._held = CopyPins()              # slab slots pinned for the copies
        # non-blocking mode (`extra` > 0, bench/NOTES.md "Session 7, h28"): `extra` copies beyond the adapted limit,
        # and the kernel does not wait for the copies' event but each staged expert's programs for a flag (the
        # mechanism of gpu_worker/up_dma.py: an epoch copied after each batch), so copies that overrun the dense
        # stretch delay only their own experts. The kernel counts programs that gave up waiting at flags[k] (its
        # top-k, >= n_slots: the guess may be filtered): the room past the slots is for that count alone.
        self.extra = 0
        self.batch = 2
        # how a batch's flag gets its epoch (`flag_write`): "copy", an 8-byte copy by the copy engine after the
        # batch's copies; "write", a stream memory write (cuStreamWriteValue64) after them. Session 27's decode
        # timeline (H100): each flag copy stalled the copy stream ~15 µs (the ups' copies before and after it 6-9 µs
        # apart, against ~1 µs between two ups); with the write, ~3 µs between copies and more ups staged in each
        # stretch, −0.09 ms a token. The engine sets it (MOESTREAM_STAGE_FLAG, "write" by default); "copy" here
        # for a staging made without the engine
        self.flag_write = "copy"
        self._write = None                   # cuStreamWriteValue64, loaded at the first "write"
        # the extras stop at the first rank read less than this share of its copies (0: off; `how_many`; the
        # engine sets MOESTREAM_STAGE_MIN_PRECISION's, 0.5 by default)
        self.min_precision = 0.0
        self.flags = torch.zeros(n_slots + 1 + FLAG_ROOM, dtype=torch.int64, device=self.device)
        self._epochs = torch.zeros(EPOCHS, dtype=torch.int64, pin_memory=self.cuda)
        self._epochs_np = self._epochs.numpy()
        self._flags_np = None if self.cuda else self.flags.numpy()     # the CPU's flags, written without a torch op
        self.epoch = 0
        self.wait_of: dict[int, tuple[int, int]] = {}    # expert -> (epoch, flag index) of the last stage
        # the last stage's experts: their up sections' addresses and (epoch, flag index), made at the stage (after a
        # launch) so that `take` and the route, before the next one, read them in one pass
        self._up_of: dict[int, int] = {}
        self._stage_waits: dict[int, tuple[int, int]] = {}
        self._epoch_of: dict[int, int] = {}          # ... the same split: expert -> epoch, expert -> flag index
        self._flag_of: dict[int, int] = {}
        self._core = None                    # event after the first `limit` copies (what the adapted limit judges)
        if self.cuda:     # the flags' zeroing ran on the compute stream: the first flag copies follow it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def by_address(self) -> bool:
        """True: `stage` copies from the blocks' addresses (the driver, or a memmove on the CPU); False: it needs their
        U8 views. On the CPU `stage` copies from the views where it is given them."""
        return self._memcpy is not None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def launch_gate(self) -> tuple[int, int] | None:
        """For an expert launch that reads this staging ("progress" only, else None): (epoch, per mille) for the
        kernel's gate (kernels/expert_layer.py GATE: the program that ends as that share of the grid has ended writes
        the epoch into `gate[1]`); the next `stage` waits for that epoch (pass it as `launch_epoch`)."""
        if self.after != "progress":
            return None
        self._gate_epoch += 1
        return self._gate_epoch, min(1000, max(1, round(self.gate_at * 1000)))

    def _next_buffer(self) -> None:
        """"progress": the stage goes into the other buffer (made at the first such stage), since the kernel that
        releases it may still read the one staged for it."""
        if len(self._bufs) == 1:
            b = torch.empty_like(self.buf)
            self._bufs.append(b)
            self._addresses.append([b[i].data_ptr() for i in range(b.shape[0])])
        self._current ^= 1
        self._address = self._addresses[self._current]

    @property
    def used_by_rank(self) -> list[int]:
        """How often the guess of each rank was read."""
        self._count_taken()
        return self._used_by_rank

    def _judge_now(self, layer: int, ev, n: int) -> None:
        """`layer`'s next limit: one more where its judged copies (`ev`) are done, one fewer where not."""
        lim = self.limit.get(layer, n)
        self.limit[layer] = min(lim + 1, n) if ev.query() else max(lim - 1, 1)

    def _judged(self) -> None:
        """The last take's stage, left to judge after the launch (`judge_after`), judged now."""
        if self._judge is not None:
            judge, self._judge = self._judge, None
            self._judge_now(*judge)

    def _count_taken(self) -> int:
        """The ranks the last take used, counted here (after the launch, at the next stage, or when read) and not on
        the route; returns how many of its experts were staged. A stage left to judge after the launch is judged."""
        self._judged()
        if self._taken is None:
            return 0
        slot_of, experts = self._taken
        self._taken = None
        used, n = self._used_by_rank, 0
        for e in experts:
            i = slot_of.get(e)
            if i is not None:
                used[i] += 1
                n += 1
        return n

    def count_taken(self) -> int:
        """How many experts of the last `take_rows` were staged (their ranks counted): after the launch, before the
        next stage."""
        return self._count_taken()

    def how_many(self, layer: int) -> int:
        """Copies to issue for `layer` now: its adapted limit and `extra` more. With `min_precision`, the extras stop at
        the first rank whose guesses were read less than that share of the times they were staged (a rank staged
        fewer than PRECISION_SAMPLES times counts as read): past the dense stretch the bus is busy, so a copy there
        costs its bytes, and a guess that is seldom read costs more than it saves."""
        n = len(self._address)
        lim = min(self.limit.setdefault(layer, n), n)
        extra = min(self.extra, n - lim)
        if extra and self.min_precision > 0:
            used, staged = self.used_by_rank, self.staged_by_rank
            k = 0
            while k < extra and (staged[lim + k] < PRECISION_SAMPLES
                                 or used[lim + k] >= self.min_precision * staged[lim + k]):
                k += 1
            extra = k
        return lim + extra

    def stage(self, layer: int, experts: list[int], addresses: list[int], slots: list[int], views=None,
              launch_epoch: int | None = None) -> None:
        """Copy the up sections of `experts` (their blocks at `addresses` in the registered slab; `views`: the
        same blocks as U8 tensors, for the torch path; on the CPU, given views are copied from) into the buffer, after the work queued so far on the
        current stream (the kernel that last read the buffer). `slots`: the slab slots pinned for the copies;
        they come back from `releasable` once the copies are done. launch_epoch ("progress"): the epoch that
        `launch_gate` gave the expert launch queued last (None: no such launch since the last stage: the copies wait
        for the compute stream's work, as with "value")."""
        self._count_taken()
        if self.after == "progress":
            self._next_buffer()
        n = min(len(experts), len(self._address))
        experts = experts[:n]
        ub = self.up_bytes
        if self.cuda:
            self._follow_compute(launch_epoch)
            if self._memcpy is not None:
                cp, h, dst = self._memcpy, self.stream.cuda_stream, self._address
                core = self.limit.get(layer, len(dst)) if self.extra else -1
                self._core = None
                for i in range(n):
                    rc = cp(dst[i], addresses[i], ub, h)
                    if rc:
                        raise RuntimeError(f"cuMemcpyAsync of a staged up section failed: CUDA error {rc}")
                    if self.extra and (i % self.batch == self.batch - 1 or i == n - 1):
                        self._signal(i - i % self.batch, i + 1)
                    if i + 1 == core:
                        self._core = torch.cuda.Event()
                        self._core.record(self.stream)
            else:
                buf = self._bufs[self._current]
                with torch.cuda.stream(self.stream):
                    for i in range(n):
                        buf[i, :ub].copy_(views[i][:ub], non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        elif views is None:
            cp, dst = self._memcpy, self._address
            for i in range(n):
                cp(dst[i], addresses[i], ub)
        else:
            buf = self._bufs[self._current]
            for i in range(n):
                buf[i, :ub].copy_(views[i][:ub])
        if not self.cuda and self.extra:         # the copies are done: the flags say so at once
            for b0 in range(0, n, self.batch):
                self._signal(b0, min(b0 + self.batch, n))
        for i in range(n):
            self.staged_by_rank[i] += 1
        self._waited = False
        self.layer = layer
        self.slot_of = {e: i for i, e in enumerate(experts)}
        addr, ws = self._address, self._wait_slot
        self._up_of = {e: addr[i] for i, e in enumerate(experts)}
        self._stage_waits = {e: ws[i] for i, e in enumerate(experts)} if self.extra else {}
        self._epoch_of = {e: w[0] for e, w in self._stage_waits.items()}
        self._flag_of = {e: w[1] for e, w in self._stage_waits.items()}
        self._held.add(self.done, slots)

    def _follow_compute(self, launch_epoch: int | None = None) -> None:
        """The staging stream's next work after what is queued so far on the compute stream (the kernel that last read
        the buffer): by an event (`after` "event"), or by a fresh epoch written there by a stream memory write and
        waited for here by a stream memory wait ("value"). "progress": the epoch is the last launch's (`launch_gate`),
        which its kernel writes before it ends; the compute stream's write after the kernel stays as the fallback. The
        write is queued before the wait, on a stream that never waits for this one in non-blocking mode (and in
        blocking mode only for copies queued after this wait), so the wait always ends."""
        current = torch.cuda.current_stream(self.device)
        if self.after == "event":
            self._after.record(current)
            self.stream.wait_event(self._after)
            return
        if self.after not in STAGE_AFTERS:
            raise ValueError(f"up staging after {self.after!r}: one of {', '.join(STAGE_AFTERS)}")
        if self._write is None:
            self._write = driver_write_value64()
        if self._wait is None:
            self._wait = driver_wait_value64()
        if self._write is None or self._wait is None:
            raise RuntimeError(f"MOESTREAM_STAGE_AFTER={self.after} needs libcuda's cuStreamWriteValue64 and "
                               "cuStreamWaitValue64 (event takes an event instead)")
        if self.after == "value" or launch_epoch is None:
            self._gate_epoch += 1
            launch_epoch = self._gate_epoch
        word = self.gate[1].data_ptr()
        rc = self._write(current.cuda_stream, word, launch_epoch, 0)
        if rc:
            raise RuntimeError(f"cuStreamWriteValue64 of the staging's gate failed: CUDA error {rc}")
        rc = self._wait(self.stream.cuda_stream, word, launch_epoch, WAIT_VALUE_GEQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue64 on the staging's gate failed: CUDA error {rc} "
                               "(MOESTREAM_STAGE_AFTER=event takes an event instead)")

    def _signal(self, lo: int, hi: int) -> None:
        """Slots lo..hi-1 (one batch) copied: their flag (slot lo) gets a fresh epoch, queued after the copies."""
        self.epoch += 1
        e = self.epoch
        for i in range(lo, hi):
            self._wait_slot[i] = (e, lo)
        if self.cuda and self.flag_write == "write":
            if self._write is None:
                self._write = driver_write_value64()
                if self._write is None:
                    raise RuntimeError("MOESTREAM_STAGE_FLAG=write needs libcuda's cuStreamWriteValue64")
            rc = self._write(self.stream.cuda_stream, self.flags[lo].data_ptr(), e, 0)
            if rc:
                raise RuntimeError(f"cuStreamWriteValue64 of a staged batch's flag failed: CUDA error {rc} "
                                   "(MOESTREAM_STAGE_FLAG=copy takes the copy engine instead)")
        elif self.cuda:
            slot = e % EPOCHS
            self._epochs_np[slot] = e
            rc = self._memcpy(self.flags[lo].data_ptr(), self._epochs[slot].data_ptr(), 8, self.stream.cuda_stream)
            if rc:
                raise RuntimeError(f"cuMemcpyAsync of a staged batch's flag failed: CUDA error {rc}")
        else:
            self._flags_np[lo] = e

    def gave_up(self) -> int:
        """Kernel programs that stopped waiting for a staged up's flag (a fault; a sync)."""
        return int(self.flags[len(self._address):].sum())

    def take(self, layer: int, experts: list[int], blocking: bool = True) -> dict[int, int]:
        """{expert: address of its staged up section} for those of `experts` staged for `layer` (consumed: a
        later stage overwrites them). When any is used and `blocking` (or the staging is not in non-blocking
        mode), the current stream waits for the copies first; otherwise `wait_of` gives each got expert's
        (epoch, flag) for the kernel's own wait (it holds every expert of the stage: look up only `experts`)."""
        if self.layer != layer or not self.slot_of:
            return {}
        up_of = self._up_of
        got = {e: up_of[e] for e in experts if e in up_of}
        self._consume(layer, got, blocking)
        return got

    def take_rows(self, layer: int, experts: list[int], blocks: list[int]) -> tuple[list, list, list] | None:
        """`take(layer, experts, blocking=False)` as the kernel's rows, the decode route's default (non-blocking
        mode): (up addresses, epochs, flags) aligned with `experts`, a staged expert's up section in the buffer and
        its batch's (epoch, flag), another's block (`blocks`, aligned) and (0, 0); None when nothing was staged for
        `layer`. One `map` per row over the stage's maps, made after the last launch; the ranks used are counted
        after this one (`count_taken`)."""
        if self.layer != layer or not self.slot_of:
            return None
        self._consume(layer, experts, False)
        zeros = repeat(0)
        return (list(map(self._up_of.get, experts, blocks)), list(map(self._epoch_of.get, experts, zeros)),
                list(map(self._flag_of.get, experts, zeros)))

    def _consume(self, layer: int, taken, blocking: bool) -> None:
        """A take of `layer`'s stage (`taken`: experts, some staged): the limit judged, `wait_of` handed, the ranks
        left to count, the stage consumed, the stream made to wait where the kernel will not wait per expert."""
        if self.cuda and not self._waited:
            # the copies done before the kernel needs them: one more next time; not done (it waits): one fewer.
            # In non-blocking mode the judged copies are the first `limit` (the `extra` beyond them may overrun).
            # `judge_after`: the query waits for `_count_taken`, after the launch (off the route's path)
            n = len(self._address)
            ev = self._core if self.extra and self._core is not None else self.done
            if self.judge_after:
                self._judge = (layer, ev, n)
            else:
                self._judge_now(layer, ev, n)
        # every staged expert's (epoch, flag): the got ones are those of `experts` (the route looks up no other)
        self.wait_of = self._stage_waits
        self._taken = (self.slot_of, taken)
        self.layer, self.slot_of = None, {}
        if self.cuda and not self._waited and (blocking or not self.extra) and not self._up_of.keys().isdisjoint(taken):
            torch.cuda.current_stream(self.device).wait_event(self.done)
            self._waited = True

    def releasable(self, wait: bool = False) -> list[int]:
        """Slab slots whose copies are done (wait: all of them, waiting for the copies where they still run)."""
        return self._held.releasable(wait)
