"""The repack journal: append-only JSON lines, each one fsync'ed write, so only the last line can be torn."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from expert_store.format import RepackError, fsync_dir, sync


class Journal:
    """Append-only JSON lines; each line is one fsync'ed write, so only the last line can be torn."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def create(self, header: dict) -> None:
        try:
            with open(self.path, "w") as f:
                f.write(json.dumps(header) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.path.parent)
        except OSError as e:
            self.path.unlink(missing_ok=True)
            raise RepackError(f"{self.path}: cannot create the journal ({e}); nothing was written") from e

    def read(self) -> tuple[dict, list[dict]]:
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0])
        except (IndexError, json.JSONDecodeError) as e:
            raise RepackError(f"{self.path}: unreadable journal header ({e}); remove the store directory and "
                              f"repack") from e
        records = []
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break       # a line torn by a kill: everything after it is unwritten
        return header, records

    def append(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                if os.write(fd, data) != len(data):
                    raise RepackError(f"{self.path}: short append (disk full?); rerun to resume")
                sync(fd, self.path, "a journal record")
            except OSError as e:
                raise RepackError(f"{self.path}: cannot append a journal record ({e}); the store is NOT complete: "
                                  f"fix the disk and rerun to resume") from e
            finally:
                os.close(fd)
