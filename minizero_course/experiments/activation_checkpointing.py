"""Activation checkpointing's price (the engine runs with and without it are experiments/planner.py's).

`step_times(comm, ...)` times a forward+backward of one larger TinyGPT with and without
checkpointing, interleaved (against the usual estimate of about 33% recompute), and splits the
checkpointed step's extra time into the recompute itself (the blocks' forwards that backward runs
again, timed by hooks on the blocks) and the rest: the per-call overhead of the checkpoint machinery.
`describe_recompute` writes what those figures say."""
from __future__ import annotations

import time

from minizero.activation_checkpointing import checkpoint_blocks, repeated_blocks, uncheckpoint_blocks
from minizero.data import SyntheticTokens
from minizero.models import build_model


class _BlockClock:
    """Seconds spent inside the model's blocks' forwards since `reset` (a pre- and a post-forward hook on
    each), and seconds their checkpointed recompute took (CheckpointedForward.recompute_s)."""

    def __init__(self, model):
        self.blocks = [model.get_submodule(name) for name in repeated_blocks(model)]
        self.total, self._start = 0.0, {}
        for block in self.blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _leave(self, module, args, output):
        self.total += time.perf_counter() - self._start.pop(id(module))

    def recompute(self) -> float:
        return sum(getattr(b.forward, "recompute_s", 0.0) for b in self.blocks)

    def reset(self):
        self.total, self._start = 0.0, {}
        for b in self.blocks:
            if hasattr(b.forward, "recompute_s"):
                b.forward.recompute_s = 0.0


def step_times(comm, repeats=5, gpt=None, batch=8):
    """Seconds of forward+backward with and without checkpointing, interleaved (one process's view).
    -> {"plain", "checkpointed": whole steps; "forward": the plain step's forward; "blocks_forward": the
    blocks' part of it; "recompute": the blocks' forwards run again inside the checkpointed backward}."""
    gpt = {**dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128), **(gpt or {})}
    model = build_model("tiny-gpt", seed=0, **gpt)
    clock = _BlockClock(model)
    x, y = SyntheticTokens(gpt["vocab_size"], gpt["block_size"]).batch(0, batch)
    times = {"plain": [], "checkpointed": [], "forward": [], "blocks_forward": [], "recompute": []}
    for _ in range(repeats + 1):  # the first round warms up
        for mode in ("plain", "checkpointed"):
            (checkpoint_blocks if mode == "checkpointed" else uncheckpoint_blocks)(model)
            clock.reset()
            t0 = time.perf_counter()
            loss = model(x, y)[1]
            t1 = time.perf_counter()
            in_forward = clock.total
            clock.reset()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            times[mode].append(t2 - t0)
            if mode == "plain":
                times["forward"].append(t1 - t0)
                times["blocks_forward"].append(in_forward)
            else:
                times["recompute"].append(clock.recompute())
    return {k: v[1:] for k, v in times.items()}


def describe_recompute(plain: float, checkpointed: float, forward: float, blocks_forward: float,
                       recompute: float) -> str:
    """What checkpointing cost, split into the recompute and the per-call overhead (seconds in, Markdown out)."""
    extra = checkpointed - plain
    overhead = extra - recompute
    def pct(t):
        return f"{t / plain:.0%}"
    s = (f"Checkpointing made the step {pct(extra)} longer ({plain * 1e3:.1f} → {checkpointed * 1e3:.1f} ms). The "
         f"recompute itself, the blocks' forwards run again inside backward, took {recompute * 1e3:.1f} ms "
         f"({pct(recompute)} of "
         "the plain step). ")
    if overhead >= 0:
        s += (f"The rest, {overhead * 1e3:.1f} ms ({pct(overhead)}), is the per-call overhead of the checkpoint "
              "machinery (saving and unpacking hooks, a context entered per block, a second module call), and noise. ")
    else:
        s += (f"The rest is negative ({overhead * 1e3:.1f} ms): the step grew by less than the recompute took, so the "
              "timing noise here is larger than the machinery's overhead (and a checkpointed forward, which keeps "
              "nothing for backward, can itself be faster than a plain one). ")
    if abs(recompute / blocks_forward - 1) <= 0.25:
        s += (f"The recompute is about what the blocks' forward cost in the plain step ({blocks_forward * 1e3:.1f} "
              "ms), as it should be: the same arithmetic run again. ")
    elif recompute < blocks_forward:
        s += (f"The recompute took {recompute / blocks_forward:.2f}× the blocks' forward in the plain step "
              f"({blocks_forward * 1e3:.1f} ms): torch stops each recompute once it has every tensor backward needs, "
              "and the plain forward's time includes its hooks and any wait for a core. ")
    else:
        s += (f"The recompute took {recompute / blocks_forward:.1f}× the blocks' forward in the plain step "
              f"({blocks_forward * 1e3:.1f} ms): the same arithmetic, run slower (inside backward, on a shared "
              "machine). ")
    s += (f"A whole forward (embeddings, blocks, head and loss) was {pct(forward)} of the plain step; the recompute "
          + ("stayed within one forward." if recompute <= forward
             else f"exceeded one forward ({recompute / forward:.1f}×)."))
    if overhead > recompute:
        s += (" The overhead was larger than the recompute: on a model this small each block's arithmetic is short, "
              "and the machinery around it is a fixed cost per call; on a large model the recompute dominates.")
    elif overhead >= 0:
        s += " The overhead was smaller than the recompute."
    return s


# ------------------------------------------------------------------ selective recomputation (lesson 11)
MODES = ("none", "selective", "full")


def granularities(gpt=None, batch=4, repeats=5) -> dict:
    """One TinyGPT measured under no checkpointing, selective recomputation and full checkpointing, in this
    process: the bytes autograd saved in block h.0 (memory.SavedTensors), next to Korthikanti's formula
    for TinyGPT's layer (fp32, no dropout) and the ledger's known extras (experiments.tensor.unmodelled_bytes:
    the LayerNorm statistics, and the causal mask where the core attention keeps it), and the CPU seconds of
    this thread in a forward+backward and in the recompute inside it (time.thread_time, one torch thread:
    what was computed, without the waits for a core that a loaded machine adds), the three modes
    interleaved, medians of `repeats`."""
    import statistics

    import torch

    from minizero import memory
    from minizero.activation_checkpointing import checkpointed
    from minizero_course.experiments.tensor import unmodelled_bytes
    gpt = {**dict(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64), **(gpt or {})}
    model = build_model("tiny-gpt", seed=0, **gpt)
    x, y = SyntheticTokens(gpt["vocab_size"], gpt["block_size"]).batch(0, batch)
    s, h, a = gpt["block_size"], gpt["n_embd"], gpt["n_head"]
    out = {"shape": dict(gpt, batch=batch), "saved": {}, "formula": {}, "extras": {}, "step_cpu_s": {},
           "recompute_cpu_s": {}}
    times = {m: ([], []) for m in MODES}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread_time sees this thread only
    try:
        for round_ in range(repeats + 1):  # round 0 measures the bytes and warms up
            for mode in MODES:
                uncheckpoint_blocks(model)
                if mode != "none":
                    checkpoint_blocks(model, granularity=mode)
                regions = checkpointed(model).values()
                for r in regions:
                    r.recompute_cpu_s = 0.0
                if round_ == 0:
                    with memory.SavedTensors({"h.0": model.h[0]}, exclude=model) as meter:
                        loss = model(x, y)[1]
                    out["saved"][mode] = meter.bytes["h.0"]
                    loss.backward()
                else:
                    t0 = time.thread_time()
                    model(x, y)[1].backward()
                    times[mode][0].append(time.thread_time() - t0)
                    times[mode][1].append(sum(r.recompute_cpu_s for r in regions))
                model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
        uncheckpoint_blocks(model)
    for mode in MODES:
        out["formula"][mode] = memory.activation_bytes(batch, s, h, 1, a, bytes_per=4, dropout=False,
                                                       checkpointing={"none": False}.get(mode, mode))
        # full: only the block input; none: LayerNorm statistics + causal mask; selective: the mask is recomputed
        out["extras"][mode] = {"none": unmodelled_bytes(s, batch), "selective": unmodelled_bytes(s, batch) - s * s,
                               "full": 0}[mode]
        out["step_cpu_s"][mode] = statistics.median(times[mode][0])
        out["recompute_cpu_s"][mode] = statistics.median(times[mode][1])
    return out


def attention_share(seq: int, hidden: int) -> float:
    """The core attention's share of a layer's forward multiply-adds: 4·b·s²·h (q·kᵀ and ·v) against the
    linear layers' 24·b·s·h² (qkv 3h², projection h², MLP 8h²), i.e. s / (6h + s)."""
    return seq / (6 * hidden + seq)


def describe_granularities(r: dict) -> str:
    """What the three modes measured say (figures in, Markdown out): bytes against the formula, CPU time against
    none."""
    saved, step, rec = r["saved"], r["step_cpu_s"], r["recompute_cpu_s"]
    exact = all(saved[m] == r["formula"][m] + r["extras"][m] for m in MODES)
    s = (("Every mode's measured bytes equal the formula plus the known extras, to the byte. " if exact else
          "The measured bytes differ from formula + extras in " + ", ".join(
              f"{m} ({saved[m] - r['formula'][m] - r['extras'][m]:+,.0f} B)" for m in MODES
              if saved[m] != r["formula"][m] + r["extras"][m]) + ". ")
         + f"Selective kept {saved['selective'] / saved['none']:.0%} of the plain layer's bytes, full "
         f"{saved['full'] / saved['none']:.1%}. ")
    for mode in ("selective", "full"):
        extra = step[mode] / step["none"] - 1
        s += (f"{mode.capitalize()} made the step's CPU time {abs(extra):.0%} {'longer' if extra >= 0 else 'shorter'} "
              f"({step['none'] * 1e3:.1f} → {step[mode] * 1e3:.1f} ms), its recompute taking "
              f"{rec[mode] * 1e3:.1f} ms. ")
    cost = rec["selective"] / rec["full"] if rec["full"] > 0 else float("nan")
    gain = (saved["none"] - saved["selective"]) / (saved["none"] - saved["full"])
    sh = r["shape"]
    share, gpt3_share = attention_share(sh["block_size"], sh["n_embd"]), attention_share(2048, 12288)
    s += (f"The selective recompute took {cost:.0%} of the full one's time and saved {gain:.0%} of what full saved, so "
          + ("per byte saved it was the cheaper of the two here. " if cost < gain else
             "per byte saved full was the cheaper of the two here. ")
          + f"Both sides of that trade depend on the shape. The bytes: the scores grow with a·s/h "
          f"({sh['n_head'] * sh['block_size'] / sh['n_embd']:.0f} here), the linear outputs do not. The time: the core "
          f"attention is s/(6h + s) = {share:.0%} of a layer's multiply-adds at s = {sh['block_size']}, "
          f"h = {sh['n_embd']}"
          + (f", and its recompute took {cost:.0%} of the full one's: per multiply-add its small batched matmuls and "
             "softmax ran slower than the linear layers. " if cost > 1.25 * share else
             f", and its recompute took {cost:.0%} of the full one's, about in proportion. ")
          + "At "
          f"Korthikanti's GPT-3 layer (a = 96, s = 2048, h = 12288) 5as/h = {5 * 96 * 2048 / 12288:.0f} against 34, so "
          f"selective drops {1 - _gpt3('selective') / _gpt3(False):.0%} of a layer's bytes, "
          f"for {gpt3_share:.1%} of its "
          "forward arithmetic: there selective wins on both counts.")
    return s


def _gpt3(checkpointing) -> float:
    from minizero.memory import activation_bytes
    return activation_bytes(1, 2048, 12288, 1, 96, checkpointing=checkpointing)
