"""A Hugging Face GPT2LMHeadModel (code minizero was not designed around) through ZeRO-3 and the engine on 2 ranks:
trained against one process on the global batch, saved, consolidated, and loaded back with strict=True.
Run by tests/test_outside.py when `transformers` is installed (the optional `outside` extra)."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import minizero
from minizero.runtime.checkpoint import consolidate
from minizero.zero import FSDP

CFG = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: the comparison is exact arithmetic
STEPS, ROWS, LR = 3, 4, 0.1  # ROWS per rank; SGD: Adam would turn last-bit noise into lr-sized steps


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CFG, attn_implementation="eager"))


def global_batch(step, world):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(CFG["vocab_size"], (ROWS * world, CFG["n_positions"]), generator=gen)


def single_process(world):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        ids = global_batch(step, world)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def run(comm, tmp_dir):
    rank, world = comm.rank, comm.size
    reference = single_process(world)
    out = {}
    model = FSDP(build(), comm)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        ids = global_batch(step, world)[rank * ROWS:(rank + 1) * ROWS]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    full = model.state_dict()
    out["fsdp_keys_match"] = sorted(full) == sorted(reference)
    out["fsdp_vs_single"] = max_diff(full, reference)
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
              "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = minizero.initialize(model=build(), config=config, comm=comm)
    for step in range(STEPS):
        ids = global_batch(step, world)[rank * ROWS:(rank + 1) * ROWS]
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()
    engine.save_checkpoint(f"{tmp_dir}/ckpt")
    comm.barrier()
    if rank == 0:
        consolidate(f"{tmp_dir}/ckpt", f"{tmp_dir}/full.pt")  # DeepSpeed's zero_to_fp32, no ranks
        fresh = GPT2LMHeadModel(GPT2Config(**CFG, attn_implementation="eager"))
        state = torch.load(f"{tmp_dir}/full.pt")
        result = fresh.load_state_dict(state, strict=True)
        out["strict_load"] = [list(result.missing_keys), list(result.unexpected_keys)]
        out["engine_vs_single"] = max_diff(fresh.state_dict(), reference)
    return out
