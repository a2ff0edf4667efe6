"""What tests/test_tensor.py launches (never inside pytest). One 4-rank job covers t = 4 (one tp
group) and t = 2 (two tp groups x DDP over dp = 2), each with and without sequence parallelism,
tied and untied: 8 lockstep runs against the single-process model; then the engine with
tensor_parallel.autotp_size = 2 over ZeRO stages 0-3 (dp = 2), against one process."""
import torch

from minizero.comm import Mesh
from minizero_course.experiments.tensor import side_by_side

torch.set_num_threads(1)


def run_all(comm):
    out = {}
    for t in (4, 2):
        mesh = Mesh(comm, tp=t)
        for sp in (False, True):
            for tied in (False, True):
                out[f"t{t}/sp{int(sp)}/tied{int(tied)}"] = side_by_side(mesh, sp, tied)
    out["engine"] = engine_runs(comm)
    out["bench"] = bench_tp(comm)
    return out


BENCH_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def bench_tp(comm):
    """`bench --tp`'s worker at its smallest (t = 2, one timed step): minizero TP next to torch DTensor TP."""
    from minizero_course.bench.tensor_parallel import worker
    return worker(comm, sizes=(2,), steps=1, warmup=0, batch=2, model_kwargs=BENCH_GPT)


# ------------------------------------------------------------------------------ the engine, dp=2 x tp=2
ENGINE_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=True)
ENGINE_RUNS = ((0, True), (1, True), (2, True), (3, False))  # (ZeRO stage, sequence parallel)
STEPS, MICRO, ACC, CLIP, LR = 3, 2, 2, 0.3, 0.1


def _batch(i, rows):
    from minizero.data import SyntheticTokens
    return SyntheticTokens(ENGINE_GPT["vocab_size"], ENGINE_GPT["block_size"]).batch(i, rows)


def _single_process(dp_size):
    """One process on the global batch: SGD with momentum, accumulation, torch's clip_grad_norm_."""
    from minizero.models import GPTConfig, TinyGPT
    model = TinyGPT(GPTConfig(**ENGINE_GPT))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    norms = []
    for step in range(STEPS):
        for i in range(ACC):
            (model(*_batch(step * ACC + i, MICRO * dp_size))[1] / ACC).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return model, norms


def _full_params(engine):
    """The single-process parameters from the engine's pieces (dp shards, then tp slices)."""
    from minizero.models import GPTConfig, TinyGPT
    from minizero.tensor import TensorParallelGPT, gather_full, unshard
    tp = engine.mesh.tp
    if engine.stage < 3:
        return gather_full(engine.module, tp)
    layout = TensorParallelGPT(TinyGPT(GPTConfig(**ENGINE_GPT)), tp)  # the same slicing, to read the dims
    dims = {n: p for n, p in layout.named_parameters() if hasattr(p, "tensor_parallel_dim")}
    out = {}
    for name, local in engine.wrapped.gather_full_params().items():
        if name in dims:
            buf = torch.empty((tp.size, *local.shape))
            tp.all_gather(buf, local.contiguous())
            local = unshard(list(buf.unbind(0)), dims[name].tensor_parallel_dim, dims[name].tensor_parallel_chunks)
        out[name] = local
    return out


def engine_runs(comm):
    from minizero.data import shard
    from minizero_course.experiments.tensor import worst
    from minizero.models import GPTConfig, TinyGPT
    from minizero.runtime.engine import build_engine
    out = {}
    for stage, sp in ENGINE_RUNS:
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACC, "gradient_clipping": CLIP,
               "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
               "tensor_parallel": {"autotp_size": 2, "sequence_parallel": sp}}
        engine = build_engine(TinyGPT(GPTConfig(**ENGINE_GPT)), cfg, comm)
        norms = []
        for step in range(STEPS):
            for i in range(ACC):
                x, y = shard(_batch(step * ACC + i, MICRO * engine.dp_size), engine.dp_rank, engine.dp_size)
                engine.backward(engine(x, y))
                engine.step()
            norms.append(engine.get_global_grad_norm())
        ref, ref_norms = _single_process(engine.dp_size)
        out[f"stage{stage}/sp{int(sp)}"] = {
            "params": worst(_full_params(engine), dict(ref.named_parameters())), "norms": norms, "ref_norms": ref_norms,
            "dp": [engine.dp_rank, engine.dp_size], "tp": [engine.mesh.tp_rank, engine.mesh.tp_size],
            "train_batch_size": engine.train_batch_size()}
    return out
