import torch, tempfile, json
from minizero import memory
from minizero.data import SyntheticTokens, shard
from minizero.runtime.engine import initialize
from minizero.models import build_model
torch.set_num_threads(1)
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
def run(comm, stage, off=None, steps=3, fp16=False, opt={"type":"SGD","params":{"lr":0.1,"momentum":0.9}}, init=False, extra=None):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 100}
    if off: zero.update(off)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": opt, "zero_optimization": zero, "fp16": {"enabled": fp16, "initial_scale_power": 8}}
    if init:
        from minizero.zero.init import Init
        with Init():
            model = build_model("tiny-gpt", seed=0, **GPT)
    else:
        model = build_model("tiny-gpt", seed=0, **GPT)
    e = initialize(model, cfg, comm)
    losses=[]
    for s in range(steps):
        for i in range(2):
            x, y = shard(SyntheticTokens(64, 16).batch(s*2+i, 2*comm.size), comm.rank, comm.size)
            l = e(x, y); e.backward(l); e.step()
        losses.append(l.item())
    sd = e.full_state_dict()
    return e, losses, torch.cat([v.reshape(-1).float() for v in sd.values()])
def main(comm):
    out = {}
    for stage in (1, 2, 3):
        e0, l0, p0 = run(comm, stage)
        e1, l1, p1 = run(comm, stage, {"offload_optimizer": {"device": "cpu"}})
        out[stage] = (torch.equal(p0, p1), (p0-p1).abs().max().item(), e1.offload_traffic(), str(e1.memory()).splitlines()[-4:])
    with tempfile.TemporaryDirectory() as d:
        e2, l2, p2 = run(comm, 3, {"offload_optimizer": {"device": "nvme", "nvme_path": d}, "sub_group_size": 1000})
        out["nvme"] = ((p0-p2).abs().max().item(), e2.offload_traffic(), str(e2.memory()))
    e3, l3, p3 = run(comm, 3, {"offload_optimizer": {"device": "cpu"}}, init=True)
    out["init"] = (p3-p1).abs().max().item()
    e4, l4, p4 = run(comm, 2, {"offload_optimizer": {"device": "cpu", "dpu_warmup_steps": 1}}, steps=4)
    out["dpu"] = (l4, e4.offload.steps)
    e5, l5, p5 = run(comm, 3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device":"cpu"}}, fp16=True)
    out["fp16"] = (l5, e5.offload_traffic())
    return out
