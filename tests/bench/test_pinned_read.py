"""bench.kernels.pinned_read under the interpreter: every reader's sums match the bytes, and a reader pointed one row
off does not (the check the benchmark prints beside each speed can fail)."""
import torch

from bench.kernels import pinned_read
from bench.kernels.pinned_read import ROW_WORDS, _expected, tma_sum


def test_every_reader_reads_the_right_bytes(tmp_path):
    res = pinned_read.main(["--gib", "0.001", "--out", str(tmp_path / "p.json")])
    readers = {r["reader"] for r in res["rows"]}
    assert readers == {"copy", "ld", "tma"}
    assert all(r.get("checked") for r in res["rows"]), res["rows"]


def test_a_shifted_tma_read_fails_the_check():
    g = torch.Generator().manual_seed(5)
    src = torch.randint(-2**31, 2**31 - 1, (64 * ROW_WORDS,), dtype=torch.int32, generator=g)
    part = torch.empty(4, dtype=torch.int32)
    nb = tma_sum(torch.tensor([src.data_ptr()], dtype=torch.int64), 32 * ROW_WORDS * 4, 4, 2, 4, part)
    assert torch.equal(part, _expected(src.view(torch.uint8), 4, nb // 16))
    shifted = torch.tensor([src.data_ptr() + 4 * ROW_WORDS], dtype=torch.int64)     # one row further on
    tma_sum(shifted, 32 * ROW_WORDS * 4, 4, 2, 4, part)
    assert not torch.equal(part, _expected(src.view(torch.uint8), 4, nb // 16))
