"""Kernel tests: Triton runs under its interpreter when there is no GPU (set before any kernel is defined)."""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request):
    # a fresh, but reproducible, draw per test
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
