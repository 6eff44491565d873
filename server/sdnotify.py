"""sd_notify(3) for Type=notify units: one datagram of KEY=VALUE lines to $NOTIFY_SOCKET, a no-op without it.

Ten lines of stdlib, as vLLM's and llama.cpp's proposals do: the PyPI packages for it are unmaintained
(`sdnotify`, 2017) or need libsystemd (`systemd-python`)."""
from __future__ import annotations

import os
import socket


def notify(*lines: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]          # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False
