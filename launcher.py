"""moestream launcher.

Until the server and the streaming pipeline land (issues 6 and 7), this runs the model in one process:
with `--model DIR` a NemotronH checkpoint in the HuggingFace layout, without it a tiny synthetic demo model
(random weights, written once under the user's cache directory) so that the command works on any machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def demo_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moestream"
    return cache / "demo-tiny-nvfp4"


def ensure_demo_model() -> Path:
    out = demo_model_dir()
    if not (out / "config.json").exists():
        from tools.synth import synthesize
        print(f"writing a tiny synthetic demo model to {out} (once)", file=sys.stderr)
        tmp = out.with_name(out.name + ".partial")
        synthesize(tmp, preset="tiny", quant="nvfp4", seed=0)
        tmp.rename(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the synthetic demo model)")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)

    import torch
    from tokenizers import Tokenizer

    from gpu_worker.generate import generate
    from gpu_worker.sampling import SamplingParams
    from nemotron.checkpoint import CheckpointError
    from nemotron.config import ConfigError
    from nemotron.model import NemotronH

    if a.model:
        model_dir = Path(a.model)
    else:
        model_dir = ensure_demo_model()
        print("note: no --model given; serving the synthetic demo model. Its weights are random, "
              "so its text is gibberish by design.", file=sys.stderr)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    try:
        model = NemotronH(model_dir, device=a.device, dtype=dtype)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.exists():
        print(f"error: {tok_path} is missing: the checkpoint carries no tokenizer", file=sys.stderr)
        return 2
    tok = Tokenizer.from_file(str(tok_path))
    ids = tok.encode(a.prompt).ids
    params = SamplingParams(temperature=a.temperature, seed=a.seed, max_tokens=a.max_tokens,
                            stop_token_ids=tuple(model.config.eos_token_ids))
    t0 = time.perf_counter()
    out = []
    sys.stdout.write(a.prompt)
    for step in generate(model, ids, params):
        out.append(step.token)
        sys.stdout.write(tok.decode([step.token], skip_special_tokens=False))
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f} s: {len(out) / dt:.1f} tokens/s "
          f"on {a.device}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
