"""Block reads: O_DIRECT on a real disk, buffered fallback on tmpfs, alignment and short reads."""
import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_shm"))
from moestream_fake_store import make_fake_store  # noqa: E402

import zlib  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from io_workers.reader import ReadError, open_blocks, read_block, read_block_crc  # noqa: E402

DISK_DIR = Path(__file__).resolve().parents[2] / ".pytest_tmp_reader"


@pytest.fixture(scope="module")
def disk_store():
    # the repo's filesystem is a real disk here; /tmp may be too, /dev/shm never is
    d = DISK_DIR / str(os.getpid())
    st = make_fake_store(d, n_layers=1, n_experts=6)
    yield st
    for p in d.iterdir():
        p.unlink()
    d.rmdir()
    try:
        DISK_DIR.rmdir()
    except OSError:
        pass


@pytest.fixture()
def shm_store():
    d = Path("/dev/shm") / f"moestream-test-{os.getpid()}"
    st = make_fake_store(d, n_layers=1, n_experts=3)
    yield st
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _slot(stride):
    return mmap.mmap(-1, stride)     # page-aligned, like a slab slot


def test_direct_read_on_disk(disk_store):
    fd, is_direct, warning = open_blocks(disk_store.experts_path, "auto")
    try:
        if not is_direct:
            pytest.skip(f"O_DIRECT not available on this filesystem: {warning}")
        assert warning is None
        for e in range(disk_store.n_experts):   # includes the last block, which ends the file unpadded
            buf = _slot(disk_store.block_stride)
            n = read_block(fd, memoryview(buf), int(disk_store.offsets[0, e]), disk_store.block_bytes, True)
            assert n >= disk_store.block_bytes
            assert buf[:disk_store.block_bytes] == disk_store.block(0, e)
    finally:
        os.close(fd)


def test_direct_read_checks_alignment(disk_store):
    fd, is_direct, _ = open_blocks(disk_store.experts_path, "auto")
    try:
        if not is_direct:
            pytest.skip("no O_DIRECT here")
        buf = _slot(disk_store.block_stride + 4096)
        with pytest.raises(ReadError, match="misaligned O_DIRECT read"):
            read_block(fd, memoryview(buf)[512:512 + disk_store.block_stride], 0, disk_store.block_bytes, True)
        with pytest.raises(ReadError, match="misaligned"):
            read_block(fd, memoryview(buf)[:disk_store.block_stride], 100, disk_store.block_bytes, True)
    finally:
        os.close(fd)


def test_refused_direct_falls_back_with_one_line_warning(shm_store, monkeypatch):
    """tmpfs refused O_DIRECT before Linux 6.6 (this kernel's accepts it): simulate the refusal."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    fd, is_direct, warning = open_blocks(shm_store.experts_path, "auto")
    try:
        assert not is_direct
        assert "O_DIRECT refused" in warning and "buffered" in warning and "\n" not in warning
        buf = _slot(shm_store.block_stride)
        read_block(fd, memoryview(buf), int(shm_store.offsets[0, 1]), shm_store.block_bytes, False)
        assert buf[:shm_store.block_bytes] == shm_store.block(0, 1)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        open_blocks(shm_store.experts_path, "on")


def test_probe_on_tmpfs(shm_store):
    """Whatever this kernel's tmpfs says about O_DIRECT, the probe's answer reads correct bytes."""
    fd, is_direct, warning = open_blocks(shm_store.experts_path, "auto")
    try:
        assert (warning is None) == is_direct
        buf = _slot(shm_store.block_stride)
        read_block(fd, memoryview(buf), int(shm_store.offsets[0, 2]), shm_store.block_bytes, is_direct)
        assert buf[:shm_store.block_bytes] == shm_store.block(0, 2)
    finally:
        os.close(fd)


def test_buffered_equals_direct(disk_store):
    fd_d, is_direct, _ = open_blocks(disk_store.experts_path, "auto")
    fd_b, b_direct, _ = open_blocks(disk_store.experts_path, "off")
    try:
        assert not b_direct
        for e in range(disk_store.n_experts):
            a, b = _slot(disk_store.block_stride), _slot(disk_store.block_stride)
            off = int(disk_store.offsets[0, e])
            read_block(fd_d, memoryview(a), off, disk_store.block_bytes, is_direct)
            read_block(fd_b, memoryview(b), off, disk_store.block_bytes, False)
            assert a[:disk_store.block_bytes] == b[:disk_store.block_bytes]
    finally:
        os.close(fd_d)
        os.close(fd_b)


def test_short_read_is_reported(disk_store):
    fd, is_direct, _ = open_blocks(disk_store.experts_path, "auto")
    try:
        end = os.fstat(fd).st_size // 4096 * 4096
        buf = _slot(disk_store.block_stride)
        with pytest.raises(ReadError, match=r"short read: \d+ of \d+ bytes .*store truncated"):
            read_block(fd, memoryview(buf), end, disk_store.block_bytes, is_direct, "experts.bin")
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_chunked_read_with_overlapped_crc(disk_store, direct):
    fd, is_direct, _ = open_blocks(disk_store.experts_path, direct)
    pool = ThreadPoolExecutor(5)
    try:
        for n_chunks in (1, 2, 3, 5):
            for e in range(disk_store.n_experts):
                buf = _slot(disk_store.block_stride)
                n, crc = read_block_crc(fd, memoryview(buf), int(disk_store.offsets[0, e]),
                                        disk_store.block_bytes, is_direct, pool, n_chunks)
                assert n >= disk_store.block_bytes
                assert buf[:disk_store.block_bytes] == disk_store.block(0, e)
                assert crc == int(disk_store.checksums[0, e]) == zlib.crc32(disk_store.block(0, e))
        end = os.fstat(fd).st_size // 4096 * 4096
        with pytest.raises(ReadError, match=r"short read: \d+ of \d+ bytes .*store truncated"):
            read_block_crc(fd, memoryview(_slot(disk_store.block_stride)), end, disk_store.block_bytes,
                           is_direct, pool, 3)
    finally:
        pool.shutdown()
        os.close(fd)
