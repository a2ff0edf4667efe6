"""Activation checkpointing's price (the engine runs with and without it are experiments/planner.py's).

`step_times(comm, ...)` times a forward+backward of one larger TinyGPT with and without
checkpointing, interleaved (against the usual estimate of about 33% recompute)."""
from __future__ import annotations

import time

from minizero.activation_checkpointing import checkpoint_blocks, uncheckpoint_blocks
from minizero.data import SyntheticTokens
from minizero.models import build_model


def step_times(comm, repeats=5, gpt=None, batch=8):
    """Seconds of forward+backward with and without checkpointing, interleaved (one process's view)."""
    gpt = {**dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128), **(gpt or {})}
    model = build_model("tiny-gpt", seed=0, **gpt)
    x, y = SyntheticTokens(gpt["vocab_size"], gpt["block_size"]).batch(0, batch)
    times = {"plain": [], "checkpointed": [], "forward": []}
    for _ in range(repeats + 1):  # the first round warms up
        for mode in ("plain", "checkpointed"):
            (checkpoint_blocks if mode == "checkpointed" else uncheckpoint_blocks)(model)
            t0 = time.perf_counter()
            loss = model(x, y)[1]
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            times[mode].append(t2 - t0)
            if mode == "plain":
                times["forward"].append(t1 - t0)
    return {k: v[1:] for k, v in times.items()}
