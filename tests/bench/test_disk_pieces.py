"""bench.disk_pieces runs end to end on a small file: every mode reads its blocks, the file is removed after."""
from __future__ import annotations

import json

from bench import disk_pieces
from io_workers import reader


def test_every_mode_reads_and_nothing_is_left(tmp_path):
    out = tmp_path / "o.json"
    assert disk_pieces.main(["--dir", str(tmp_path), "--out", str(out), "--blocks", "2", "--block-mb", "0.25",
                             "--pieces", "3"]) == 0
    r = json.loads(out.read_text())
    assert set(r["modes"]) == {"whole", "threads3", "thread_fds3", "procs3"}
    for m in r["modes"].values():
        assert len(m["ms"]) == 2 and all(x > 0 for x in m["ms"]) and m["gbps"] > 0
    assert not (tmp_path / "disk_pieces.bin").exists()


def test_pieces_cover_the_block_once():
    """The split the bench measures is the IO workers' own (io_workers.reader.block_pieces)."""
    assert disk_pieces.block_pieces is reader.block_pieces
    parts = disk_pieces.block_pieces(3 * 2**20, 16)
    assert parts[0][0] == 0 and parts[-1][1] == 3 * 2**20
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))        # contiguous, no overlap
    assert all(a % disk_pieces.ALIGN == 0 for a, _ in parts)
