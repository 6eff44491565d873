"""The engine's measuring knobs read from the environment, each through kernels/env.py's one parser (re-exported
here for the process packages' callers)."""
from __future__ import annotations

from kernels.env import env_count, env_count_or_off, env_switch  # noqa: F401


def decode_ahead() -> bool:
    """`MOESTREAM_DECODE_AHEAD` (1 by default; 0: off): the next decode step's first stretch is queued with the
    sampled token still on the device, before the host reads it (gpu_worker/decode_graphs.py `DecodeGraphs.begin`).
    On since session 27's H100 run: −0.075 ms a token at 8 MoE layers, lower in 11 of 12 paired rounds in one engine
    (bench/NOTES.md)."""
    return env_count_or_off("MOESTREAM_DECODE_AHEAD", 1, "switch (1: on)") > 0


def prefetch_guess_ranks() -> int:
    """`MOESTREAM_PREFETCH_GUESS_RANKS` (16 by default since session 33; 0: the whole guess): at decode, each layer's
    request carries only the next layer's first N guessed experts (the next router's likeliest): only those are read
    ahead from the disk and kept by the prefetcher's touch. Past rank 16 of Super's 22 the guesses are read mostly
    in vain (ranks 17-22 used 0.15-0.35 of the time against 0.55-0.80 for ranks 13-16), and where the disk sets the
    pace each wasted read shares the disk with the demand reads a layer waits for. Session 30 (three H100 hosts, 27
    pairs): 12 against the whole guess −5.7 ms a token on average. Session 33 (the disk regime in one engine, each
    arm its own prompts, two H100 hosts, 51 pairs): 16 against 12 lower in 33, −6.3 and −1.6 ms a token on average by
    host, the same disk bytes a token and a hit rate 0.005-0.015 higher (bench/NOTES.md). Models that route 16
    experts or fewer are not cut. Read once a token (`StreamingExperts._send` at the first MoE layer), so one engine
    can A/B it. The staging of the RAM regime (the guessed ups copied into VRAM) always takes the whole guess."""
    return env_count_or_off("MOESTREAM_PREFETCH_GUESS_RANKS", 16, "guessed experts a layer (0: all)")


def read_chunks() -> int:
    """`MOESTREAM_READ_CHUNKS` (4 by default): each IO worker reads a block in this many concurrent preadv calls, each
    chunk's crc32 taken by its thread (io_workers/reader.py). Read by `Supervisor` as it starts the workers, so a
    disk probe and the engine after it in one process read the same way. Session 30 (the GPU hosts' virtual disk):
    in the disk regime 16 against 4 was within that disk's noise, and on a quiet disk one preadv of 3 MB took 1.47 ms
    against 2.0-2.5 in 4-16 pieces on threads (bench.disk_pieces); 4 stays: its pieces overlap the crc32 with the
    read, and 1 at the pipeline's depth is not measured (bench/NOTES.md, session 30)."""
    return env_count("MOESTREAM_READ_CHUNKS", 4, "concurrent reads a block")


def prefetch_hold() -> bool:
    """`MOESTREAM_PREFETCH_HOLD` (0 by default; 1: on): while decoding, the prefetcher starts no read ahead while a
    demand read is pending or out (`CacheClient.hold_ahead`), so the reads a layer waits for share the disk with
    fewer others. Session 30's IO trace: a demand read took ~11 ms with the reads ahead around it (5 in flight),
    1.5 ms on a quiet disk, and cutting the guess to 12 ranks (fewer reads ahead) served them in 6.5 ms. Held, a read
    ahead starts later and may itself become a wait. Measured in one engine on two H100 hosts: −5.1 ms a token (session
    31, 10 of 12 pairs lower), then level (session 33: +0.08, 6 of 12; with the whole guess −0.56, 7 of 12), so it
    stays off. Read once a token (`StreamingExperts._send` at the first MoE layer), so one engine can A/B it
    (`bench.e2e_stream --ab-regime disk --ab-env MOESTREAM_PREFETCH_HOLD=1`)."""
    return env_count_or_off("MOESTREAM_PREFETCH_HOLD", 0, "switch (1: on)") > 0


def vram_copy_stream() -> bool:
    """`MOESTREAM_VRAM_COPY_STREAM` (1 by default; 0: off): the VRAM tier's copies (frequency admissions, the
    whole-layer fill, a lend's restore) run on a copy stream of their own instead of the compute stream, and each batch
    becomes resident (its rows and the device table) at the first token whose check finds it copied
    (gpu_worker/vram_tier.py `VramTier.settle`), so no kernel waits for them. Session 35 call 1 (H100, 8 MoE layers,
    one engine, three rounds): in a settled tier level with the copies inline (within 0.1 ms a token in every window);
    refilling after a lent 16k prompt the first 8 tokens 13.0 -> 8.2 ms. Read once a token
    (`StreamingExperts._fill_vram`), so one engine can A/B it (`bench.lend_decode --arms`)."""
    return env_switch("MOESTREAM_VRAM_COPY_STREAM", True)


def vram_fill_blocks() -> int:
    """`MOESTREAM_VRAM_FILL_BLOCKS` (64 by default; 0: no whole-layer fill): blocks a whole-layer fill of the VRAM tier
    copies a token (Super: 64 are ~200 MB, ~3.6 ms of H2D; a layer is whole after 8 tokens). Read once a token."""
    return env_count_or_off("MOESTREAM_VRAM_FILL_BLOCKS", 64, "blocks a token")
