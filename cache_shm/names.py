"""Names of one run's shared-memory objects, and the sweep of what dead runs left.

Every object of a run is named `/moestream-<owner pid>-<token>-<what>`; on Linux shared memory
appears as `/dev/shm/moestream-...` and a semaphore as `/dev/shm/sem.moestream-...`. The owner pid in
the name is what lets a later start tell a dead run's leftovers from a live run's objects.
"""
from __future__ import annotations

import os
import secrets

import posix_ipc

SHM_DIR = "/dev/shm"
NAME_ROOT = "moestream-"


def new_prefix(owner_pid: int | None = None) -> str:
    """A fresh per-run prefix, e.g. `/moestream-1234-9f2c01ab-`."""
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"/{NAME_ROOT}{pid}-{secrets.token_hex(4)}-"


def owner_pid_of(entry: str) -> int | None:
    """The owner pid encoded in a /dev/shm entry name, or None if it is not one of ours."""
    name = entry[4:] if entry.startswith("sem.") else entry
    if not name.startswith(NAME_ROOT):
        return None
    try:
        return int(name[len(NAME_ROOT):].split("-", 1)[0])
    except ValueError:
        return None


def pid_alive(pid: int) -> bool:
    """True if `pid` runs and is not a zombie (an unreaped dead owner counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def list_entries(prefix: str | None = None) -> list[str]:
    """Entries in /dev/shm of one run (`prefix` as from new_prefix) or of every moestream run."""
    want = (prefix or "/" + NAME_ROOT).lstrip("/")
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(want) or n.startswith("sem." + want))


def unlink_entry(entry: str) -> None:
    """Unlink one /dev/shm entry by its directory name; a missing one is not an error."""
    try:
        if entry.startswith("sem."):
            posix_ipc.unlink_semaphore("/" + entry[4:])
        else:
            posix_ipc.unlink_shared_memory("/" + entry)
    except posix_ipc.ExistentialError:
        pass


def sweep_stale(log=None) -> list[str]:
    """Unlink every moestream object whose owner process is dead; returns the entries removed."""
    removed = []
    for entry in list_entries():
        pid = owner_pid_of(entry)
        if pid is None or pid_alive(pid):
            continue
        unlink_entry(entry)
        removed.append(entry)
    if removed and log is not None:
        log(f"cache_shm: swept {len(removed)} stale shared-memory objects of dead runs")
    return removed
