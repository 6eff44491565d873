"""A byte progress bar on stderr (tqdm), or none."""
from __future__ import annotations


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="repack", smoothing=0.1)
