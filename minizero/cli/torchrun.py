"""`python -m minizero torchrun [torchrun's arguments]`: torchrun, saying what it waits for and
cleaning up after.

torchrun itself (torch.distributed.run, run here in this process with the arguments as given) has
three habits a course trips over, all in its agent, before any minizero code runs in a worker:
  * with `--nnodes 2` and one agent started, it waits silently for the other: 600 s under the c10d
    rendezvous (join_timeout), 900 s under the static one (timeout), then prints a traceback of its
    own code;
  * it leaves its log folder, torchelastic_*, in the temp directory, every run;
  * a worker that fails adds torchrun's own ChildFailedError traceback and table after minizero's
    one message.
Here, with several nodes, the agent says what it waits for (how many agents, where, for how long)
before it waits, for MINIZERO_INIT_TIMEOUT_S (default 60 s) unless --rdzv-conf sets the limit; a
rendezvous that does not complete is one line and exit 2; torchrun's log folder is a temporary one,
removed at the end (unless --log-dir names one); a failed worker is one line with its exit code,
which this command exits with.
"""
from __future__ import annotations

import shutil
import sys
import tempfile

# the key of each rendezvous' wait for every agent
TIMEOUT_KEY = {"c10d": "join_timeout", "static": "timeout"}


def _say(text: str):
    sys.stderr.write(f"minizero torchrun: {text}\n")
    sys.stderr.flush()


def main(argv=None) -> int:
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from minizero import env
    args = torchrun.get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    backend = "c10d" if args.standalone else args.rdzv_backend
    where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    if max_nodes > 1 and not args.standalone:
        key = TIMEOUT_KEY.get(backend)
        conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
        if key and key not in conf:  # torchrun's own default is 10 or 15 minutes of silence
            conf[key] = f"{env.get('MINIZERO_INIT_TIMEOUT_S'):g}"
            args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
        limit = f"up to {conf[key]} s (--rdzv-conf {key}=S sets it)" if key else ("as long as its "
                                                                                  "rendezvous does")
        others = "with --node-rank 1, 2, ..." if backend == "static" else ("with the same "
                                                                           "--rdzv-endpoint")
        _say(f"this agent waits {limit} for {min_nodes} agents (nodes) at {where} ({backend} "
             f"rendezvous): start `torchrun --nnodes {args.nnodes}` on every other node {others}")
    own_logs = args.log_dir is None
    if own_logs:
        args.log_dir = tempfile.mkdtemp(prefix="minizero-torchrun-")
    try:
        torchrun.run(args)
    except (RendezvousError, DistError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        _say(f"the rendezvous at {where} did not complete: {type(e).__name__}"
             + (f": {first}" if first != type(e).__name__
             else "") + f". Were all {args.nnodes} agents started with the same --nnodes and "
                        "rendezvous, and can they "
             "reach that address? (MINIZERO_INIT_TIMEOUT_S or --rdzv-conf sets the wait)")
        return 2
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1  # a signal's negative code: 1
        _say(f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"
             + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "") + "; its message is "
                                                                                 "above")
        return code
    finally:
        if own_logs:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
