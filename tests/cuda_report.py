"""The largest TinyGPT that trains under a capped GPU memory, with and without ZeRO-Offload, on one GPU
(the "10x bigger model on one GPU" claim, in miniature; not a pytest module: `python tests/cuda_report.py`).

A study, minutes long, so not part of the bounded check: `make test-gpu` (tests/gpu/check.py) checks the
quantizer and the offload at a world of one (losses, ledger by location, bytes each way, CUDA peak) with
every other mechanism. Each attempt runs in a child process whose CUDA memory is capped
(set_per_process_memory_fraction): doubling the layers, then bisection. Prints one JSON object.
"""
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)



CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 1000,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}


def _config(stage, offload, fp16):
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg = {**CFG, "zero_optimization": zero}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train(n_layer, n_embd, offload, steps, fp16=True, stage=2, seq=128):
    """One run in this process: losses, CUDA peak, ledger by location, bytes copied."""
    import minizero
    from minizero.data import SyntheticTokens
    from minizero.models import GPTConfig, TinyGPT
    cfg = GPTConfig(vocab_size=64, block_size=seq, n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd)
    model = TinyGPT(cfg, seed=0)
    psi = sum(p.numel() for p in model.parameters())
    cuda = torch.cuda.is_available()
    if cuda:
        import gc
        gc.collect()  # an earlier run's engine in this process: gone before this one is measured
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0  # what this run did not allocate
    engine, _, _, _ = minizero.initialize(model=model, config=_config(stage, offload, fp16))
    init_peak = torch.cuda.max_memory_allocated() - base if cuda else None  # building the engine
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # from here: the training steps
    data = SyntheticTokens(cfg.vocab_size, cfg.block_size, seed=0)
    losses, times = [], []
    for step in range(steps):
        x, y = data.batch(step, 2)
        t0 = time.perf_counter()
        loss = engine(x.to(engine.device), y.to(engine.device))  # the loss, as DeepSpeed
        engine.backward(loss)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ledger = engine.memory()
    return {"n_layer": n_layer, "n_embd": n_embd, "psi": psi, "offload": offload, "losses": losses,
            "step_s": times, "ledger_by_location": ledger.by_location, "ledger_by_category": ledger.by_category,
            "cuda_max_allocated": torch.cuda.max_memory_allocated() - base if cuda else None,
            "cuda_init_peak": init_peak, "cuda_after_steps": torch.cuda.memory_allocated() - base if cuda else None,
            "traffic": engine.offload_traffic()}


def _child(args):
    """`python cuda_report.py child N_LAYER N_EMBD OFFLOAD CAP_GB`: one capped attempt, JSON on the last line."""
    n_layer, n_embd, offload, cap = int(args[0]), int(args[1]), args[2] == "1", float(args[3])
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap * 2 ** 30 / total)
    try:
        r = train(n_layer, n_embd, offload, steps=2)
        print(json.dumps({"ok": True, "psi": r["psi"], "cuda_max_allocated": r["cuda_max_allocated"],
                          "cuda_init_peak": r["cuda_init_peak"], "cuda_after_steps": r["cuda_after_steps"],
                          "step_s": r["step_s"][-1]}))
    except torch.OutOfMemoryError as e:
        print(json.dumps({"ok": False, "why": str(e).splitlines()[0][:200]}))


def _attempt(n_layer, n_embd, offload, cap):
    proc = subprocess.run([sys.executable, __file__, "child", str(n_layer), str(n_embd), str(int(offload)), str(cap)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "why": (proc.stderr or proc.stdout)[-300:]}


def largest(n_embd, offload, cap, hi):
    """The most layers (of width n_embd) that train 2 steps under `cap` GiB: doubling, then bisection."""
    good, tried = None, {}
    lo_bad = None
    n = 1
    while n <= hi:
        tried[n] = _attempt(n, n_embd, offload, cap)
        if not tried[n]["ok"]:
            lo_bad = n
            break
        good, n = n, n * 2
    if good is None:
        return {"layers": 0, "tried": tried}
    upper = lo_bad if lo_bad is not None else hi + 1
    while upper - good > 1:
        mid = (good + upper) // 2
        tried[mid] = _attempt(mid, n_embd, offload, cap)
        good, upper = (mid, upper) if tried[mid]["ok"] else (good, mid)
    return {"layers": good, "psi": tried[good]["psi"], "cuda_max_allocated": tried[good]["cuda_max_allocated"],
            "cuda_init_peak": tried[good]["cuda_init_peak"], "cuda_after_steps": tried[good]["cuda_after_steps"],
            "step_s": tried[good]["step_s"], "tried": {k: v["ok"] for k, v in sorted(tried.items())}}


def main():
    if sys.argv[1:2] == ["child"]:
        return _child(sys.argv[2:])
    if not torch.cuda.is_available():
        print("the largest-model study needs a CUDA GPU (its cap is torch.cuda's per-process memory fraction); "
              "`make test-gpu ARGS=--quick` is the CPU smoke run of the checks", file=sys.stderr)
        return 2
    cap, width = 2.0, 1024
    print(json.dumps({"env": {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)},
                      "largest_under_cap": {"cap_GiB": cap, "n_embd": width,
                                            "plain": largest(width, False, cap, hi=64),
                                            "offload": largest(width, True, cap, hi=128)}}))


if __name__ == "__main__":
    sys.exit(main())
