"""`deepspeed.add_config_arguments(parser)`: the command-line flags DeepSpeed's scripts parse.

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)   # the launcher passes it
    parser = minizero.add_config_arguments(parser)              # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    # reads args.deepspeed_config
    engine, optimizer, _, _ = minizero.initialize(args=args, model=model, ...)

The flags are DeepSpeed's (deepspeed/__init__.py's _add_core_arguments), help text included;
--deepscale and --deepscale_config are its deprecated spellings, hidden as there.
"""
from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed "
                            "backend)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
