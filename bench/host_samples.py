"""Where a process's host time goes, from py-spy's raw samples (`py-spy record -f raw`: one line per distinct stack,
"frame;frame;...;frame count", outermost first, each frame "function (file:line)").

    python -m bench.host_samples SPY.txt [--under _prefill] [--top 25] [--out host_samples.json]

Only the samples whose stack passes through a frame whose function is --under (default: the prefill's MoE step,
`_prefill`) are counted: a benchmark's set-up and its other threads drop out. Prints, for those samples, the
functions by inclusive share (the share of samples with the function anywhere on the stack, counted once per sample)
and by self share (the innermost frame), each as file:function; writes the same as JSON. Sampling rate and the
samples' count give the seconds: py-spy's default drops idle samples (a thread blocked in the kernel, e.g. waiting
for the device), so the shares are of the host's busy time.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """'function (path/to/file.py:123)' -> 'file.py:function' (the line dropped, so a function is one row)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    return f"{m.group('file').rsplit('/', 1)[-1]}:{m.group('fn')}"


def parse(lines) -> list[tuple[list[str], int]]:
    """[(frames outermost first, count)] of py-spy's raw lines; malformed lines are skipped."""
    out = []
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        out.append(([frame_name(f) for f in stack.split(";")], int(n)))
    return out


def _is(frame: str, name: str) -> bool:
    """frame 'file.py:function' is of function `name` (py-spy names methods Class.method: either form matches)."""
    fn = frame.rsplit(":", 1)[-1]
    return fn == name or fn.endswith("." + name)


def summarize(samples, under: str) -> dict:
    """Inclusive and self counts of the samples with a frame of function `under` (from that frame inward)."""
    incl, self_, total = Counter(), Counter(), 0
    for frames, n in samples:
        at = next((i for i, f in enumerate(frames) if _is(f, under)), None)
        if at is None:
            continue
        inner = frames[at:]
        total += n
        for f in set(inner):
            incl[f] += n
        self_[inner[-1]] += n
    return dict(under=under, samples=total, inclusive=dict(incl.most_common()), self=dict(self_.most_common()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spy")
    ap.add_argument("--under", default="_prefill")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    with open(a.spy) as f:
        res = summarize(parse(f), a.under)
    n = max(res["samples"], 1)
    print(f"{res['samples']} samples under {a.under}")
    for kind in ("inclusive", "self"):
        print(f"{kind:>9} % | function")
        for name, c in list(res[kind].items())[:a.top]:
            print(f"{100 * c / n:11.1f} | {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
