"""`python -m minizero plan`: memory per GPU and bytes per link before you launch anything.

    python -m minizero plan --table zero-paper        # ZeRO paper Table 1, recomputed
    python -m minizero plan --params 7e9 --gpus 4     # DDP vs ZeRO-1/2/3 model states, inference
    python -m minizero plan --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 \
        --gpus 16 --tp 2 --pp 2 --zero 1 --micro-batch 4 --micro-batches 8 [--sp] \
        [--checkpointing] [--json]
    python -m minizero plan --params 7e9 --seq 131072 --gpus 64 --cp 8 [--ulysses] --zero 1 \
        --checkpointing
    python -m minizero plan --params 1e9 --experts 8 --gpus 16 --ep 8 --zero 1
    python -m minizero plan --params 1.5e9 --gpus 16 --global-batch 64 --fit 40 --hardware a100-eth
    python -m minizero plan --params 1e9 --gpus 16 --zero 0 --precision fp32 \
        --optimizer onebitadam --freeze-step 15000 --steps 100000  # 1-bit Adam: bytes per phase
                                                                   # and over the run
    python -m minizero plan --params 1e9 --seq 8192 --gpus 8 --zero 1 \
        --sparse-attention '{"mode": "fixed", "block": 64}'  # the layout's kept scores, not s²

The first two print the ZeRO paper's model states. Any shape or strategy flag asks the planner
(minizero/planner/): per-rank memory by category (model states, activations, the largest transient
buffers) per pipeline stage and the bytes each rank sends per step by link class; --fit lists the
layouts that fit, ranked by the alpha-beta + FLOP step-time estimate. GB = 1e9 bytes.
"""
from __future__ import annotations

import argparse
import re

import json
import sys
from dataclasses import replace

from minizero.memory import PAPER_TABLE1, estimate, inference_bytes, zero_paper_table1
from minizero.planner import HARDWARE, ModelShape, PlanError, ParallelStrategy, fit, plan, step_time
from minizero.planner.plan import FREEZE_STEP

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


# Every number is range-checked here, at the edge: a bad one is one line naming the flag, the value
# and the allowed range, exit 2, before anything is computed. The bounds are generous but keep the
# formulas honest (no negative, zero, nan or infinite rates) and the tables readable:
# 1000x the largest trained models; 16 B/param x 1e15 = 1.6e7 GB still fits a column
MAX_PARAMS = 1e15
MAX_GPUS = 1_000_000      # 10x the largest clusters
# --fit plans every layout (cp and ep too), each in O(dp x cp + pp) per stage: 1e12 params on
MAX_FIT_GPUS = 1024
                          # 1024 GPUs take 2.7 s here (8.1 s before cp: each stage built the whole
                          # grid); 4096 GPUs minutes
MAX_COUNT = 1_000_000     # batch sizes, micro-batches, tp, pp, dp, --top: far beyond any run
MAX_K = 64  # optimizer bytes per parameter: mixed Adam 12, fp64 Adam with fp64 masters 24
# shape flags: far past today's largest (GPT-3: 96 layers, h 12288, 96 heads; 1e6-token contexts;
# 256k vocabularies)
SHAPE_MAX = {"layers": 100_000, "hidden": 1_000_000, "heads": 100_000, "seq": 100_000_000,
             "vocab": 100_000_000}
MAX_NODE = 4096           # GPUs per node: 8 on a DGX, 72 on an NVL72 rack
MAX_MEMORY_GB = 100_000   # --fit, per GPU: an H200 has 141 GB
MAX_FLOPS = 1e18          # per GPU: an H100 does 989e12 dense bf16
MAX_BW = 1e14             # bytes/s per rank: NVLink 5 is 9e11
MAX_EXPERTS = 100_000     # experts per MoE layer: Switch-C has 2048
MAX_CAPACITY_FACTOR = 64  # slots per expert over the even share: GShard/Switch use 1-2
MAX_STEPS = 10 ** 12      # optimizer steps of a run: far beyond any
# --sparse-attention builds its [heads, nb, nb] bool layout: 64M blocks a head at most
MAX_LAYOUT_BLOCKS = 8192


def _parse(text: str) -> float:
    """A number as people write it: 7e9, 7000000000, 7B, 1.3b, 350M, 0.4."""
    m = re.fullmatch(
        r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?\d+)?|[-+]?(?:nan|inf))\s*([kmbgt]?)\s*",
        text,
        re.IGNORECASE,
    )
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


def _num(x: float, digits=6) -> str:
    # 1e6 and 1e15, not 1e+06 and 1e+15
    return f"{x:.{digits}g}".replace("e+0", "e").replace("e+", "e")


def _in_range(lo: float, hi: float, integer=False, open_low=False):
    """An argparse type: a number in [lo, hi] ((lo, hi] with open_low), a whole one with integer."""
    allowed = (
        "a whole number" if integer else "a number"
    ) + f" in {'(' if open_low else '['}{_num(lo)}, {_num(hi)}]"

    def check(text: str):
        value = _parse(text)
        if not (lo < value <= hi if open_low else lo <= value <= hi) or (
            integer and value != int(value)
        ):
            raise argparse.ArgumentTypeError(f"got {text.strip()}, allowed: {allowed}")
        return int(value) if integer else value
    return check


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: every message names its flag
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
    # 13 wide: the largest allowed total, (4 + MAX_K) x
    # MAX_PARAMS bytes = 68000000.00 GB, keeps 2 spaces
    print(f"{'strategy':<10}" + "".join(f"{c:>13}" for c in ("params", "grads", "optimizer",
                                                             "total")))
    for name, stage in (("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)):
        e = estimate(num_params, gpus, stage, k)
        print(f"{name:<10}" + "".join(f"{b / 1e9:>13.2f}" for b in (e.parameters, e.gradients,
                                                                    e.optimizer_state,
                                                                      e.total)))
    print("\nInference, weights only (one full copy, no KV cache):")
    for dtype in ("fp32", "fp16", "int8", "int4"):
        print(f"{dtype:<10}{inference_bytes(num_params, dtype) / 1e9:>13.2f} GB")


def print_stages(p, times=None) -> None:
    s = p.strategy
    cp = f" x cp {s.cp}{' (Ulysses)' if s.ulysses else ''}" if s.cp > 1 else ""
    ep = f", ep {s.ep} of {p.shape.experts} experts" if p.shape.experts else ""
    print(f"{s.name()}: {p.shape.num_params() / 1e9:.3g}B parameters on {s.world} GPUs (dp {s.dp} "
          f"x pp {s.pp}{cp} x tp {s.tp}{ep}, {s.node_size} per node), micro-batch {s.micro_batch} "
          f"x {s.micro_batches}, {s.precision}, {s.optimizer}")
    for st in p.stages:
        cells = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in st.memory.items() if v)
        host = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in st.host.items() if v)
        print(
            f"  stage {st.stage}: {st.params / 1e6:.4g}M params/rank; device GB: {cells}"
            + (
                "; transient: " + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in st.transient.items())
                if st.transient
                else ""
            )
            + f"; total {st.device_total / 1e9:.3g}"
            + (f"; host GB: {host}" if host else "")
        )
        sent = ", ".join(f"{g} {b / 1e9:.3g} ({st.link[g]})" for g, b in st.sent.items())
        links = st.sent_by_link
        print(f"    sent per step GB: {sent or 'nothing'}; intra-node "
              f"{links['intra-node'] / 1e9:.3g}, cross-node {links['cross-node'] / 1e9:.3g}")
        ob = st.onebit
        if ob:
            print(f"    1-bit Adam, dp GB per step: warm-up {ob['warmup_step'] / 1e9:.3g}, "
                  f"compressed {ob['compressed_step'] / 1e9:.3g} ({ob['step_reduction']:.1f}x "
                  "fewer)"
                  + (f"; over {ob['steps']} steps with {ob['warmup_steps']} of warm-up: "
                     f"{ob['run_bytes'] / 1e9:.3g} vs Adam's {ob['adam_run_bytes'] / 1e9:.3g} "
                     f"({ob['run_reduction']:.2f}x fewer)"
                     if "steps" in ob else " (give --steps for the run)"))
    if p.shape.attention_density < 1:
        print(f"  sparse attention: {p.shape.attention_density:.3g} of the a·s² scores kept (the "
              "layout's)")
    if times:
        print("  estimated step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()))


def _attention_density(text: str, shape, parser) -> float:
    """The kept fraction of the a·s² scores for a DeepSpeed sparse_attention section (JSON), from
    its layout."""
    from minizero.sparse import from_section, score_bytes
    try:
        section = json.loads(text)
        config = from_section(section, shape.heads)
        blocks = shape.seq // config.block
        if blocks > MAX_LAYOUT_BLOCKS:
            raise ValueError(f"--seq {shape.seq} / block {config.block} = {blocks} blocks per "
                             f"side, allowed: at most {MAX_LAYOUT_BLOCKS} (the layout is built: a "
                             "larger block)")
        layout = config.make_layout(shape.seq)
    except (ValueError, TypeError) as e:  # json's errors are ValueErrors; the layouts' too
        parser.error(f"argument --sparse-attention: {e}".replace("sparse_attention: ", ""))
    return score_bytes(layout, 1, config.block, 1, config.causal) / (shape.heads * shape.seq ** 2)


def _layout_flags(args) -> list[str]:
    """The flags that fix a layout (what --fit searches over), as given."""
    given = [f"--{n}" for n in ("tp", "pp", "cp", "ep") if getattr(args, n) != 1]
    given += [
        f"--{n.replace('_', '-')}"
        for n in ("dp", "zero", "schedule")
        if getattr(args, n) is not None
    ]
    given += [
        f"--{n}"
        for n in ("offload", "sp", "checkpointing", "qwz", "hpz", "qgz", "ulysses")
        if getattr(args, n)
    ]
    return given + (["--micro-batches"] if args.micro_batches != 1 else [])


def _planner(args, parser) -> int:
    if args.layers is not None:
        missing = [
            f"--{n}" for n in ("hidden", "heads", "seq", "vocab") if getattr(args, n) is None
        ]
        if missing:
            parser.error(f"--layers needs {' '.join(missing)} too (or give --params alone)")
        shape = ModelShape(args.layers, args.hidden, args.heads, args.seq, args.vocab, args.tied)
    elif args.params is not None:
        shape = ModelShape.from_params(args.params, hidden=args.hidden, seq=args.seq or 1024,
                                       vocab=args.vocab or 50257, heads=args.heads)
    else:
        parser.error("give the model: --params N, or --layers --hidden --heads --seq --vocab")
    shape = replace(shape, experts=args.experts or 0, top_k=args.top_k,
                    capacity_factor=args.capacity_factor)
    if args.sparse_attention is not None:
        shape = replace(shape,
                        attention_density=_attention_density(args.sparse_attention, shape, parser))
    if shape.hidden % shape.heads:
        parser.error(f"--hidden {shape.hidden} does not divide by --heads {shape.heads}: every "
                     "head gets hidden / heads dimensions" + ("" if args.heads else " (without "
                                                                                    "--heads: "
                                                                                    "hidden // 128 "
                                                                                    "heads)"))
    if args.layers is not None and shape.num_params() > MAX_PARAMS:  # (--params is checked above)
        parser.error(f"this shape has {_num(shape.num_params(), 3)} parameters, allowed: at most "
                     f"{_num(MAX_PARAMS)} (as --params)")
    hw = replace(HARDWARE[args.hardware],
                 **{k: v for k, v in (("flops", args.flops), ("mfu", args.mfu),
                 ("intra_bw", args.intra_bw), ("inter_bw", args.inter_bw)) if v is not None})
    world = args.gpus or 1
    fixed = _layout_flags(args)
    if args.fit is not None and fixed:
        parser.error(f"--fit searches every layout itself; it cannot take {' '.join(fixed)} (it "
                     "would ignore them). Leave them out, or plan that one layout without --fit")
    if args.fit is not None and world > MAX_FIT_GPUS:
        parser.error(f"argument --gpus: got {world} with --fit, allowed: a whole number in [1, "
                     f"{MAX_FIT_GPUS}] (--fit plans every layout and would take minutes; plan one "
                     "layout with --tp --pp --zero instead)")
    try:
        if args.fit is not None:
            ranked = fit(shape, world, args.fit * 1e9, hw,
                         args.global_batch or args.micro_batch * world, args.node_size,
                         args.micro_batch, args.precision, args.optimizer,
                         FREEZE_STEP if args.freeze_step is None else args.freeze_step,
                         args.steps or 0)
            if args.json:
                json.dump([{**p.as_dict(), "step_time": t} for p, t in ranked[:args.top]],
                          sys.stdout, indent=1)
                return 0
            print(f"{len(ranked)} layouts fit in {args.fit:g} GB on {hw.name}; fastest first:")
            for p, t in ranked[:args.top]:
                print(f"  {p.strategy.name():<34} {p.peak_device_bytes / 1e9:8.3g} GB  step "
                      f"{t['total'] * 1e3:9.1f} ms (compute {t['compute'] * 1e3:.1f}, comm "
                      f"{t['comm'] * 1e3:.1f}, offload {t['offload'] * 1e3:.1f})")
            return 0
        if args.dp is not None and args.dp * args.tp * args.pp * args.cp != world:
            cp = f" x cp {args.cp}" if args.cp > 1 else ""
            raise PlanError(f"dp {args.dp} x pp {args.pp}{cp} x tp {args.tp} = "
                            f"{args.dp * args.pp * args.cp * args.tp} is not the world size "
                            f"{world} (--gpus)")
        p = plan(
            shape,
            ParallelStrategy(
                world,
                args.node_size,
                args.tp,
                args.pp,
                args.sp,
                args.zero or 0,
                args.offload,
                args.micro_batch,
                args.micro_batches,
                args.schedule or "1f1b",
                args.checkpointing,
                args.precision,
                args.optimizer,
                qwz=args.qwz,
                hpz=args.hpz,
                qgz=args.qgz,
                cp=args.cp,
                ulysses=args.ulysses,
                ep=args.ep,
                freeze_step=FREEZE_STEP if args.freeze_step is None else args.freeze_step,
                steps=args.steps or 0,
            ),
        )
    except PlanError as e:
        parser.error(str(e))
    if args.json:
        json.dump({**p.as_dict(), "step_time": step_time(p, hw)}, sys.stdout, indent=1)
    else:
        print_stages(p, step_time(p, hw))
    return 0


def main(argv: list[str] | None = None) -> int:
    count = _in_range(1, MAX_COUNT, integer=True)
    parser = _Parser(
        prog="minizero plan",
        description="Per-GPU memory of model states for DDP and ZeRO-1/2/3 (ZeRO paper formulas).",
        epilog="examples: minizero plan --table zero-paper | minizero plan --params 7B --gpus 4")
    parser.add_argument("--table", choices=["zero-paper"], help="print a reference table")
    parser.add_argument("--params", type=_in_range(1, MAX_PARAMS),
                        help="model size, e.g. 7e9 or 7B")
    parser.add_argument("--gpus", type=_in_range(1, MAX_GPUS, integer=True), default=None,
                        help="data-parallel degree N (default 1)")
    parser.add_argument("--k", type=_in_range(0, MAX_K), default=12.0,
                        help="optimizer bytes per parameter (12 = mixed-precision Adam)")
    shape = parser.add_argument_group("model shape (the planner)")
    for name, what in (("layers", "transformer blocks"), ("hidden", "width h"),
                       ("heads", "attention heads"), ("seq", "sequence length"),
                       ("vocab", "vocabulary")):
        shape.add_argument(f"--{name}", type=_in_range(1, SHAPE_MAX[name], integer=True), help=what)
    shape.add_argument("--tied", action="store_true", help="lm_head shares wte's weight")
    shape.add_argument("--experts", type=_in_range(1, MAX_EXPERTS, integer=True),
                       help="MoE: experts per block (default dense)")
    shape.add_argument("--top-k", type=int, choices=(1, 2), default=1,
                       help="MoE: experts per token (default 1)")
    shape.add_argument("--capacity-factor", type=_in_range(0, MAX_CAPACITY_FACTOR, open_low=True),
                       default=1.25,
                       help="MoE: slots per expert over the even share (default 1.25)")
    strat = parser.add_argument_group("strategy (the planner)")
    strat.add_argument("--node-size", type=_in_range(1, MAX_NODE, integer=True), default=8,
                       help="GPUs per node (default 8)")
    for name, what in (("tp", "tensor-parallel"), ("pp", "pipeline stages"),
                       ("cp", "context-parallel (s/cp tokens per rank)"),
                       ("ep", "expert-parallel (with --experts)")):
        strat.add_argument(f"--{name}", type=count, default=1, help=f"{what} size (default 1)")
    strat.add_argument("--ulysses", action="store_true",
                       help="context parallelism by DeepSpeed-Ulysses' all-to-alls (with --cp)")
    strat.add_argument("--dp", type=count, help="data-parallel size (default: gpus / (tp x pp))")
    strat.add_argument("--zero", type=int, choices=range(4), help="ZeRO stage over the DP group")
    strat.add_argument("--offload", action="store_true",
                       help="ZeRO-Offload of the optimizer to the host")
    strat.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    strat.add_argument("--checkpointing", action="store_true",
                       help="activation checkpointing per block")
    strat.add_argument("--qwz", action="store_true",
                       help="ZeRO++ int8 weight all-gathers (--zero 3)")
    strat.add_argument("--hpz", action="store_true",
                       help="ZeRO++ secondary partition per node (--zero 3)")
    strat.add_argument("--qgz", action="store_true",
                       help="ZeRO++ int4 hierarchical gradient all-to-all (--zero 3)")
    strat.add_argument("--micro-batch", type=count, default=1,
                       help="sequences per rank per micro-batch")
    strat.add_argument("--micro-batches", type=count, default=1,
                       help="accumulation = pipeline micro-batches")
    strat.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None,
                       help="pipeline schedule (default 1f1b)")
    strat.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="bf16")
    strat.add_argument("--optimizer", choices=("adam", "sgd", "onebitadam"), default="adam",
                       help="onebitadam: 1-bit Adam (zero 0, fp32): Adam's all-reduce for "
                            "--freeze-step steps, then the momentum in 1 bit")
    strat.add_argument("--freeze-step", type=_in_range(0, MAX_STEPS, integer=True),
                       help="1-bit Adam's warm-up steps (default 100000, DeepSpeed's)")
    strat.add_argument("--steps", type=_in_range(1, MAX_STEPS, integer=True),
                       help="1-bit Adam: the run's length, for its bytes over the run")
    strat.add_argument("--sparse-attention", metavar="JSON",
                       help="DeepSpeed's sparse_attention section, e.g. '{\"mode\": \"fixed\", "
                            "\"block\": 16}'")
    search = parser.add_argument_group("--fit: which layouts fit, fastest first")
    search.add_argument("--fit", type=_in_range(0, MAX_MEMORY_GB, open_low=True),
                        metavar="MEMORY_GB", help="device memory per GPU, GB")
    search.add_argument("--global-batch", type=count,
                        help="sequences per step (default micro-batch x gpus)")
    search.add_argument("--top", type=count, default=10, help="how many to list")
    search.add_argument("--hardware", choices=sorted(HARDWARE), default="h100-ib",
                        help="; ".join(f"{k}: {v.name}" for k, v in HARDWARE.items()))
    for name, what, top in (("flops", "peak FLOP/s per GPU", MAX_FLOPS),
                            ("mfu", "fraction of peak reached", 1),
                            ("intra-bw", "intra-node bytes/s", MAX_BW),
                            ("inter-bw", "cross-node bytes/s", MAX_BW)):
        search.add_argument(f"--{name}", type=_in_range(0, top, open_low=True),
                            help=f"override the hardware's {what}")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON (for notebooks)")
    args = parser.parse_args(argv)
    planner_flags = (args.layers, args.zero, args.fit, args.dp, args.global_batch)
    if (
        any(v is not None for v in planner_flags)
        or args.json
        or args.checkpointing
        or args.offload
        or args.sp
        or args.qwz
        or args.hpz
        or args.qgz
        or args.tp > 1
        or args.pp > 1
        or args.micro_batches > 1
        or args.cp > 1
        or args.ep > 1
        or args.experts is not None
        or args.ulysses
        or args.optimizer != "adam"
        or args.freeze_step is not None
        or args.steps is not None
        or args.sparse_attention is not None
    ):
        if args.table:
            parser.error("--table prints the ZeRO paper's table; leave out the planner's flags")
        return _planner(args, parser)
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
