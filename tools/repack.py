"""Command line over the store library: repack a NemotronH checkpoint into an expert store, or verify one.

    python -m tools.repack --model CKPT --out STORE [--workers N]
    python -m tools.repack --verify STORE --model CKPT [--sample N]

The work is `expert_store.writer.repack` (resumable: rerun the same command after a kill) and
`expert_store.verify.verify` (every block, or a sample, decoded back and compared bit for bit);
docs/store-format.md has the files and the durability rules.
"""
from __future__ import annotations

import argparse
import sys

from expert_store.format import RepackError, StoreError, VerifyError
from expert_store.verify import verify
from expert_store.writer import repack
from kernels.expert_block import DOWN_GROUP_NEURONS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.repack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (hub format)")
    ap.add_argument("--out", help="store directory to write (or resume)")
    ap.add_argument("--verify", metavar="STORE", help="verify this store against --model instead of repacking")
    ap.add_argument("--sample", type=int, help="with --verify: check N random blocks instead of all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, help="threads (default min(4, cores))")
    ap.add_argument("--down-group-neurons", type=int, default=16, choices=DOWN_GROUP_NEURONS, metavar="N",
                    help="store the down projection in groups of N neurons (16, 8, 4, 2, 1; each sub-group carries a "
                         "copy of its 16-group's scales, so the sparse down reads fewer bytes; default 16)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--skip-dense", action="store_true", help="with --verify: do not compare the dense files")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.verify is None):
        ap.error("give exactly one of --out STORE or --verify STORE")
    try:
        if args.verify:
            r = verify(args.verify, args.model, args.sample, args.seed, not args.no_progress, not args.skip_dense,
                       args.workers)
            print(f"OK: {r.blocks_checked} blocks and {r.dense_tensors_checked} dense tensors match "
                  f"{args.model} bit for bit ({r.seconds:.1f} s)")
            if args.sample is not None:
                print(f"note: --sample {args.sample} checked {r.blocks_checked} random blocks; it proves nothing about "
                      "the others. Run without --sample to check every block.")
            return 0
        r = repack(args.model, args.out, args.workers, not args.no_progress,
                   down_group_neurons=args.down_group_neurons)
        if r.already_complete:
            print(f"{args.out}: already a complete store of this model; nothing to do")
        else:
            print(f"{args.out}: complete; wrote {r.bytes_written / 1e9:.3f} GB in {r.seconds:.1f} s "
                  f"({r.gb_per_s:.2f} GB/s){f', resumed after {r.resumed_blocks} blocks' if r.resumed_blocks else ''}")
        return 0
    except (RepackError, VerifyError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from nemotron.checkpoint import CheckpointError
        from nemotron.config import ConfigError
        if isinstance(e, (CheckpointError, ConfigError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
