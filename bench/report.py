"""How a bench hands back what it measured: the table printed, and the same figures as JSON and a plot where asked."""
from __future__ import annotations

import json
from pathlib import Path


def emit(res: dict, table, plot=None, json_path: Path | None = None, plot_path: Path | None = None) -> None:
    """table(res) -> str is printed; res is written to json_path; plot(res, path) draws to plot_path."""
    print(table(res))
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    if plot_path and plot is not None:
        plot(res, plot_path)
