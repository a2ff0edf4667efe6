"""`python -m minizero consolidate DIR OUT.pt`: a sharded checkpoint -> one fp32 state dict that
loads into the plain model (DeepSpeed's zero_to_fp32.py). No ranks needed: it reads every
rank's file (minizero/runtime/checkpoint.py explains the format)."""
import os
import sys

from minizero.runtime.checkpoint import CheckpointError, check_output, consolidate


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero consolidate",
                       description="write a checkpoint's full fp32 state "
                                 "dict, which loads into the plain model (DeepSpeed's "
                                 "zero_to_fp32.py)")
    ap.add_argument("dir", help="the checkpoint directory (holds `latest`)")
    ap.add_argument("out", help="where to write the state dict (torch.save)")
    ap.add_argument("--tag", default=None, help="which checkpoint (default: the one in DIR/latest)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir):
        ap.error(f"DIR {args.dir}: no such folder (give the checkpoint folder, the one that holds "
                 "`latest`)")
    try:
        check_output(args.out)  # a bad OUT is a usage error (exit 2), found before anything is read
    except CheckpointError as ex:
        print(f"consolidate: {ex}", file=sys.stderr)
        return 2
    try:
        sd = consolidate(args.dir, args.out, args.tag)
    except CheckpointError as ex:
        print(f"consolidate: {ex}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in {id(t): t for t in sd.values()}.values())
    print(f"wrote {args.out}: {len(sd)} tensors, {numel:,} values in fp32")
    return 0
