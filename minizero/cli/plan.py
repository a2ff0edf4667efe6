"""`python -m minizero plan`: memory per GPU before you launch anything.

    python -m minizero plan --table zero-paper        # ZeRO paper Table 1, recomputed
    python -m minizero plan --params 7e9 --gpus 4     # DDP vs ZeRO-1/2/3, inference

Numbers are model states only (the ZeRO paper's accounting): no activations, no
temporary buffers, no fragmentation. GB = 1e9 bytes, as in the paper.
"""
from __future__ import annotations

import argparse
import re

from minizero.memory import PAPER_TABLE1, estimate, inference_bytes, zero_paper_table1

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _count(text: str) -> float:
    """A parameter count: 7e9, 7000000000, 7B, 1.3b, 350M."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?\d+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    try:
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (try 7e9 or 7B)")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the parameter count must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of GPUs")
    if value < 1:
        raise argparse.ArgumentTypeError(f"need at least 1 GPU, got {value}")
    return value


def _nonnegative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"K (optimizer bytes per parameter) must be >= 0, got {value}")
    return value


def print_zero_paper_table() -> None:
    print("ZeRO paper (Rajbhandari et al. 2020) Table 1: per-device model states, GB,")
    print("Psi = 7.5B parameters, K = 12 (mixed-precision Adam). computed [paper]\n")
    print(f"{'N':>6}  {'P_os':>16}  {'P_os+g':>16}  {'P_os+g+p':>16}")
    for row in zero_paper_table1():
        cells = [f"{got:8.2f} [{paper:>6}]" for got, paper in zip(row[1:], PAPER_TABLE1[row.n])]
        print(f"{row.n:>6}  " + "  ".join(f"{c:>16}" for c in cells))


def print_plan(num_params: float, gpus: int, k: float) -> None:
    print(f"Model states per GPU, Psi = {num_params / 1e9:g}B parameters on {gpus} GPU(s),")
    print(f"fp16/bf16 params and grads, K = {k:g} bytes of optimizer state per parameter.")
    print("GB = 1e9 bytes; activations and temporary buffers not included.\n")
    print(f"{'strategy':<10}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}")
    for name, stage in (("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)):
        e = estimate(num_params, gpus, stage, k)
        print(f"{name:<10}{e.parameters / 1e9:>10.2f}{e.gradients / 1e9:>10.2f}"
              f"{e.optimizer_state / 1e9:>11.2f}{e.total / 1e9:>10.2f}")
    print("\nInference, weights only (one full copy, no KV cache):")
    for dtype in ("fp32", "fp16", "int8", "int4"):
        print(f"{dtype:<10}{inference_bytes(num_params, dtype) / 1e9:>10.2f} GB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="minizero plan",
        description="Per-GPU memory of model states for DDP and ZeRO-1/2/3 (ZeRO paper formulas).",
        epilog="examples: minizero plan --table zero-paper | minizero plan --params 7B --gpus 4")
    parser.add_argument("--table", choices=["zero-paper"], help="print a reference table")
    parser.add_argument("--params", type=_count, help="model size, e.g. 7e9 or 7B")
    parser.add_argument("--gpus", type=_positive_int, default=None,
                        help="data-parallel degree N (default 1)")
    parser.add_argument("--k", type=_nonnegative, default=12.0,
                        help="optimizer bytes per parameter (12 = mixed-precision Adam)")
    args = parser.parse_args(argv)
    if args.params is None and args.gpus is not None:
        parser.error("--gpus needs --params (how many parameters?)")
    if args.table is None and args.params is None:
        parser.error("nothing to plan: give --params N [--gpus N] or --table zero-paper")
    if args.table:
        print_zero_paper_table()
    if args.params is not None:
        if args.table:
            print()
        print_plan(args.params, args.gpus or 1, args.k)
    return 0
