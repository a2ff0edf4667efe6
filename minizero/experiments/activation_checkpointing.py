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
