"""What tests/test_checkpoint.py runs through minizero.launch (never inside pytest).

resume (2 ranks): for every stage, fp32 and fp16: train 10 steps, save, train 10 more; a fresh
engine loads the checkpoint and trains the same 10: losses, fp32 masters, optimizer state, loss
scale, lr and counters must be BITWISE those of the uninterrupted run. Then the error paths
(wrong model, missing shard, truncated file, flipped byte, save mid-accumulation) must change
nothing, and a save interrupted before it is published must leave `latest` and the last good
checkpoint intact. reshard (3 ranks): the 2-rank checkpoints load at 3 ranks, at 1 rank and into
another stage; the state right after loading must equal the files' bit for bit."""
import hashlib
import os
import shutil
import warnings

import torch

from minizero.runtime import checkpoint
from minizero.runtime.checkpoint import CheckpointError
from minizero.data import SyntheticTokens, shard
from minizero.runtime.engine import build_engine
from minizero.models import build_model

torch.set_num_threads(1)

GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
# One global batch of 12 rows at any world size (micro-batch 6, 3 or 2 at N = 1, 2, 3), so a
# resharded run continues the SAME training, up to the order of float additions.
BATCH, ACC, HALF = 12, 2, 10  # HALF steps, save, HALF more
CASES = [(s, d) for d in ("fp32", "fp16") for s in range(4)]


def config(stage, dtype="fp32"):
    # fp16: 2**20 overflows at first, a window of 3 doubles the scale again: the scaler's state
    # changes on both sides of the save. Adam(W) with weight decay, a warmup-decay schedule and
    # clipping give every piece of state something to do.
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": ACC, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 3 * HALF, "warmup_num_steps": 4,
                                                              "warmup_max_lr": 1e-2}},
            "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 20, "loss_scale_window": 3},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}


def make(comm, stage, dtype="fp32", **model_overrides):
    return build_engine(build_model("tiny-gpt", seed=0, **{**GPT, **model_overrides}), config(stage, dtype), comm)


def train(engine, steps):
    """`steps` optimizer steps from where the engine is: the data position is global_steps."""
    data, n, losses = SyntheticTokens(GPT["vocab_size"], GPT["block_size"]), engine.comm.size, []
    for _ in range(steps):
        total = 0  # this step's loss, summed over the micro-batches
        for i in range(ACC):
            x, y = shard(data.batch(engine.global_steps * ACC + i, BATCH // ACC), engine.comm.rank, n)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total = total + loss.detach().float().reshape(1) / ACC
        engine.comm.all_reduce(total, op="avg")  # the loss of the global batch (equal shards)
        losses.append(total.item())
    return losses


def state(engine):
    """Everything that must survive: values and optimizer state per name, scalars, scaler, counters."""
    full, scalars = checkpoint.gather(engine)
    return {"full": {n: {k: t for k, t in d.items()} for n, d in full.items()},
            "scalars": {n: {k: float(v) for k, v in d.items()} for n, d in scalars.items()},
            "scale": engine.loss_scale, "lr": engine.lr,
            "counters": [engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.global_samples]}


def same(a, b) -> list[str]:
    """What differs between two state() results (empty: bitwise identical)."""
    bad = [k for k in ("scalars", "scale", "lr", "counters") if a[k] != b[k]]
    if a["full"].keys() != b["full"].keys():
        return bad + ["names"]
    for n in a["full"]:
        for k in a["full"][n].keys() | b["full"][n].keys():
            if k not in a["full"][n] or k not in b["full"][n] or not torch.equal(a["full"][n][k], b["full"][n][k]):
                bad.append(f"{n}/{k}")
    return bad


def resume(comm, root, full=None):
    out = {}
    for stage, dtype in CASES:
        key, d = f"{stage}/{dtype}", os.path.join(root, f"s{stage}_{dtype}")
        a = make(comm, stage, dtype)
        first = train(a, HALF)
        skipped_at_save, saved = a.skipped_steps, digest(a.full_state_dict())
        a.save_checkpoint(d)
        second = train(a, HALF)
        b = make(comm, stage, dtype)
        path, _ = b.load_checkpoint(d)
        resumed = train(b, HALF)
        out[key] = {"first": first, "second": second, "resumed": resumed, "differs": same(state(a), state(b)),
                    "path": os.path.relpath(path, root), "skipped": [skipped_at_save, a.skipped_steps], "saved": saved,
                    "scales": sorted({a.loss_scale, b.loss_scale})}
    out["edge"] = edge(comm, root)
    out["errors"] = errors(comm, root, full)
    return out


def digest(sd):
    """sha256 of a state dict's names and fp32 values (what consolidate must reproduce)."""
    h = hashlib.sha256()
    for k, v in sd.items():
        h.update(k.encode() + v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def edge(comm, root):
    """The edge-case model (tied, frozen, unused parameters, a buffer) through ZeRO-3 and ZeRO-1."""
    out = {}
    for stage in (1, 3):
        cfg = {k: v for k, v in config(stage).items() if k != "scheduler"}
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
        e = build_engine(build_model("edge", seed=0), cfg, comm)
        data = SyntheticTokens(11, 6)
        for step in range(2 * ACC):
            e.backward(e(shard(data.batch(step, BATCH // ACC), comm.rank, comm.size)))  # engine((x, y))
            e.step()
        e.save_checkpoint(os.path.join(root, f"edge_s{stage}"))
        out[stage] = digest(e.full_state_dict())
    return out


def errors(comm, root, full=None):
    """Each bad checkpoint: the error text, and whether the engine's state stayed as it was."""
    src, out = os.path.join(root, "s2_fp32"), {}
    engine = make(comm, 2)
    train(engine, 1)
    before = state(engine)

    def attempt(name, load_dir, e=engine, **kw):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                returned = e.load_checkpoint(load_dir, **kw)
            out[name] = {"error": None, "returned": returned, "warnings": [str(w.message) for w in caught]}
        except CheckpointError as ex:
            out[name] = {"error": str(ex)}
        out[name]["unchanged"] = not same(before, state(engine)) if e is engine else None

    def broken(name, damage):
        d = os.path.join(root, f"broken_{name}")
        if comm.rank == 0:
            shutil.copytree(src, d)
            damage(os.path.join(d, f"global_step{HALF}"))
        comm.barrier()
        return d

    def truncate(p):
        with open(os.path.join(p, "rank1.pt"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(p, "rank1.pt")) // 2)

    def flip(p):
        with open(os.path.join(p, "rank0.pt"), "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 1]))

    attempt("missing_shard", broken("missing", lambda p: os.remove(os.path.join(p, "rank1.pt"))))
    attempt("truncated", broken("truncated", truncate))
    attempt("corrupt", broken("corrupt", flip))
    attempt("no_latest", os.path.join(root, "nothing_here"))
    other = make(comm, 2, n_embd=48)  # a different model: its own state must stay too
    other_before = state(other)
    attempt("wrong_model", src, e=other)
    out["wrong_model"]["unchanged"] = not same(other_before, state(other))
    # mid-accumulation: a save would lose the accumulated gradients
    x, y = shard(SyntheticTokens(64, 16).batch(0, BATCH // ACC), comm.rank, comm.size)
    engine.backward(engine(x, y))
    engine.step()
    try:
        engine.save_checkpoint(os.path.join(root, "mid"))
        out["mid_accumulation"] = None
    except CheckpointError as ex:
        out["mid_accumulation"] = str(ex)
    engine.backward(engine(x, y))  # the second micro-batch completes the step: saving is allowed again
    engine.step()
    blocked = os.path.join(root, "a_file")  # save_dir is a file: rank 0 cannot create it
    if comm.rank == 0:
        open(blocked, "w").close()
    comm.barrier()
    try:
        engine.save_checkpoint(blocked)
        out["unwritable"] = None
    except CheckpointError as ex:
        out["unwritable"] = str(ex)
    out["interrupted"] = interrupted(comm, root)
    out["disk_full"] = disk_full(comm, engine, root, full)
    return out


def disk_full(comm, engine, root, full):
    """A save whose rank files cannot be written, after a good one. "fake": rank 1's torch.save raises what
    torch.save makes of ENOSPC (rank 0's file is written). "real" (when the test could mount it): `full` is
    a 1 MiB tmpfs, filled until 16 KiB are left, less than either rank's file."""
    out = {}
    for name, d in (("fake", os.path.join(root, "enospc")), ("real", full)):
        if d is None:
            continue
        engine.save_checkpoint(d, tag="good")
        if name == "real" and comm.rank == 0:
            st = os.statvfs(d)
            with open(os.path.join(d, "filler"), "wb") as f:
                f.write(bytes(st.f_bavail * st.f_frsize - 16384))
        comm.barrier()
        torch_save = torch.save
        if name == "fake" and comm.rank == 1:
            def no_space(*args, **kwargs):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            torch.save = no_space
        try:
            engine.save_checkpoint(d, tag="bad")
            error = None
        except CheckpointError as ex:
            error = str(ex)
        finally:
            torch.save = torch_save
        comm.barrier()  # rank 0 removes the failed save's directory before it raises
        with open(os.path.join(d, "latest")) as f:
            latest = f.read()
        out[name] = {"error": error, "dir": d, "listing": sorted(os.listdir(d)), "latest": latest,
                     "rank_file_bytes": [os.path.getsize(os.path.join(d, "good", f"rank{r}.pt"))
                                         for r in range(comm.size)]}
    return out


def interrupted(comm, root):
    """A save that dies after every shard is written but before it is published."""
    d = os.path.join(root, "interrupted")
    a = make(comm, 3)
    train(a, 2)
    a.save_checkpoint(d)
    good = state(a)
    train(a, 2)

    def crash(point):
        raise KeyboardInterrupt(f"simulated crash at {point}")

    checkpoint._interrupt = crash
    try:
        a.save_checkpoint(d)
        crashed = False
    except KeyboardInterrupt:
        crashed = True
    finally:
        checkpoint._interrupt = None
    with open(os.path.join(d, "latest")) as f:
        latest = f.read()
    leftovers = sorted(n for n in os.listdir(d) if n.startswith("."))
    b = make(comm, 3)
    b.load_checkpoint(d)
    return {"crashed": crashed, "latest": latest, "leftovers": leftovers, "restored": not same(good, state(b)),
            "tags": sorted(n for n in os.listdir(d) if not n.startswith("."))}


def reshard(comm, root):
    """2-rank checkpoints at 3 ranks (same stage and another stage) and at 1 rank."""
    out = {}
    for stage, dtype, into in ((0, "fp32", 0), (1, "fp32", 1), (2, "fp32", 2), (3, "fp32", 3), (2, "fp16", 2),
                               (1, "fp32", 3), (3, "fp32", 0)):
        out[f"{stage}/{dtype}->{into}"] = _reshard_one(comm, root, stage, dtype, into)
    solo = comm.split(0 if comm.rank == 0 else 1)
    if comm.rank == 0:
        out["1 rank"] = _reshard_one(solo, root, 3, "fp32", 3)
    return out


def _reshard_one(comm, root, stage, dtype, into):
    d = os.path.join(root, f"s{stage}_{dtype}")
    e = make(comm, into, dtype)
    e.load_checkpoint(d)
    full, scalars = checkpoint.gather(e)
    _, meta, records = checkpoint._read(d)  # the files themselves, read here without collectives
    want, want_scalars = checkpoint._assemble(meta, records)
    differs = [f"{n}/{k}" for n in want for k in want[n] if not torch.equal(want[n][k], full[n][k])]
    differs += [n for n in want_scalars if {k: float(v) for k, v in want_scalars[n].items()} !=
                {k: float(v) for k, v in scalars[n].items()}]
    return {"differs": differs, "loaded_at": e.global_steps, "scale": e.loss_scale, "losses": train(e, HALF)}
