"""minizero.runtime.checkpoint: sharded checkpoints that resume bitwise, load at another world size
or stage, and consolidate into one plain fp32 state dict (DeepSpeed's zero_to_fp32.py).

    engine.save_checkpoint("ckpt")             # every rank: ckpt/global_step10/rank{r}.pt
    path, client_state = engine.load_checkpoint("ckpt")      # the tag in ckpt/latest
    python -m minizero consolidate ckpt model.pt             # torch.load -> model.load_state_dict

On disk (DeepSpeed's shape: one directory per tag, and a `latest` file naming the last one):
    DIR/latest              the tag of the last COMPLETE checkpoint; written last
    DIR/TAG/meta.json       world size, stage, dtype, the model's parameter names and shapes, and
                            each rank file's size and sha256 (written once every rank file is)
    DIR/TAG/rank{r}.pt      rank r's part, torch.save of plain tensors and numbers

One format for every stage and layout (DeepSpeed calls this a "universal" checkpoint). Rank r's file
holds, for each KEY, the pieces [lo, hi) of the flattened tensor whose fp32 master values r steps,
and the optimizer's elementwise state for those elements (Adam's exp_avg, exp_avg_sq; SGD's
momentum_buffer), plus that key's scalar state (Adam's step). The segments come from the engine's
data-parallel strategy (runtime/strategies.py): ZeRO-1/2 cut their one flat buffer through tensors,
ZeRO-3 cuts one per unit; stage 0 and every replicated tensor (stage 3's persistent parameters) are
written by data-parallel rank 0 only, frozen parameters and buffers by one rank of each stage. A key
is the parameter's name; with tensor parallelism each tp rank's slice is `name@tp{k}` (meta.json's
layout says how TP cut it, so consolidation puts it back with tensor.layers.unshard), and the copy
of a tied weight a later pipeline stage holds is `name@pp{s}` (kept bitwise by its own stage,
skipped when consolidating). Hence:
  * resuming at the same size and stage is bitwise: every value is copied back, none recomputed
    (with the loss scaler, the scheduler, the step counters and each rank's torch RNG state);
  * any other data-parallel size, or stage, reshards for free (tp and pp sizes must match: another
    cut is an error that says to consolidate): each rank assembles the full flat values
    from all files (they are small here; a real system reads only the overlapping pieces) and
    takes its own slices. The one thing that cannot be merged is a flat shard whose names carry
    different scalar state (stage 0 Adam steps a parameter unused in some steps fewer times):
    that is a clear error;
  * consolidation is concatenation.

Save is atomic: every rank writes into a fresh hidden DIR/.TAG.tmp-* directory (file.part, then
os.replace), rank 0 writes meta.json, renames the directory to TAG and only then replaces
`latest`. A save interrupted anywhere leaves the previous checkpoint and `latest` untouched; one
that fails (a rank's write: a full disk is named as such) also removes its .TAG.tmp-* directory
(rank 0, once the ranks agree), and a crash's leftover one goes at the next save (`minizero train`
removes it at its start, and says so). No `.part` file outlives a failure.
(Re-saving an existing TAG moves the old one aside first: between those two renames TAG is
briefly missing; its old copy survives as DIR/.TAG.old-*.) The directory must be shared by all
ranks.

Load changes nothing until everything is checked, on every rank: meta.json readable, the same
parameter names and shapes as this model, every rank file present with the recorded size and
checksum and readable, every element of every parameter covered exactly once. The ranks then vote,
so one rank's bad file stops all of them with the same error before any state is touched.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid

import torch

FORMAT = "minizero-checkpoint-2"
_interrupt = None  # tests: a function(point) called on every rank mid-save, to simulate a crash


class CheckpointError(RuntimeError):
    pass


# ---------------------------------------------------------------------------- what a rank owns
def _segments(e):
    """The strategy's segments (runtime/strategies.py), each piece named by its checkpoint KEY: the
    parameter's name, name@tp{k} for tensor-parallel ranks, name@pp{s} for a pipeline's tied
    copy."""
    return [seg._replace(pieces=[pc._replace(name=e.checkpoint_key(pc.name)) for pc in seg.pieces])
            for seg in e.strategy.segments(e.param_names)]


def _record(e, client_state=None) -> dict:
    pieces, scalars = {}, {}
    for seg in _segments(e):
        # the same on every data-parallel rank (or every node's): written once
        if not e.writes(seg):
            continue
        t, optim, segs, _ = seg
        state = optim.state.get(t, {})
        flat = {k: v.detach().reshape(-1) for k, v in state.items()
                if torch.is_tensor(v) and v.dim() > 0 and v.shape == t.shape}
        other = {k: v.clone() if torch.is_tensor(v) else v for k,
                 v in state.items() if k not in flat}
        tf = t.detach().reshape(-1)
        for name, lo, hi, off, stepped in segs:
            sl = slice(off, off + hi - lo)
            if not stepped:  # never had a gradient: no optimizer state, as torch keeps none for it
                pieces.setdefault(name, []).append((lo, hi, {"master": tf[sl].clone()}))
                continue
            pieces.setdefault(name, []).append((lo, hi, {"master": tf[sl].clone(),
                                                         **{k: v[sl].clone() for k,
                                                            v in flat.items()}}))
            scalars[name] = other
    return {
        "format": FORMAT,
        "rank": e.comm.rank,
        "world_size": e.comm.size,
        "pieces": pieces,
        "scalars": scalars,
        "extras": {n: t.detach().clone() for n, t in e.extras().items()}
        if e.saves_extras()
        else {},
        "counters": {
            k: getattr(e, k)
            for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
        },
        "loss_scaler": e.loss_scaler.state_dict() if e.loss_scaler is not None else None,
        "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
        "rng": torch.get_rng_state(),
        "client_state": client_state,
    }


def _inventory(e) -> dict:
    """What this rank holds, for meta.json and the load check: its keys and the extras it writes."""
    return {"keys": e.checkpoint_keys(),
            "extras": [[n, list(t.shape), str(t.dtype).replace("torch.", "")] for n,
                       t in e.extras().items()]
            if e.saves_extras() else []}


def _union(inventories, what) -> list:
    seen = {}
    for inv in inventories:
        for item in inv[what]:
            seen.setdefault(item[0], item)
    return list(seen.values())


def _meta(e, tag, inventories, files=None) -> dict:
    return {"format": FORMAT, "tag": tag, "world_size": e.comm.size, "stage": e.stage,
            "dtype": str(e.dtype).replace("torch.", ""), "global_steps": e.global_steps,
            "layout": e.checkpoint_layout(),
            "model_params": [[n, list(s)] for n, s in e.param_shapes],
            "params": _union(inventories, "keys"), "extras": _union(inventories, "extras"),
            "aliases": e.aliases, "state_dict_keys": e.state_dict_keys, "files": files}


# ---------------------------------------------------------------------------- save
def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path, write):
    """path.part, then os.replace: a reader sees the old file or the whole new one. On any failure
    (a full disk, path a directory, Ctrl-C) the .part file is removed and the error raised."""
    part = path + ".part"
    try:
        with open(part, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(part)
        raise


def _disk_full(ex: BaseException) -> bool:
    """ENOSPC (or a full quota), also when torch.save turned it into "[enforce fail at
    inline_container.cc:672] . unexpected pos" (the OSError is then its __context__, or lost)."""
    seen = ex
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(ex, RuntimeError) and "unexpected pos" in str(ex)


def _failure(ex: BaseException, directory: str) -> str:
    if _disk_full(ex):
        return (f"the disk is full: no space left in {directory} ({type(ex).__name__}: {ex}); "
                "free space or save elsewhere")
    return f"{type(ex).__name__}: {ex}"


def remove_interrupted_saves(save_dir) -> list[str]:
    """Remove the .TAG.tmp-* directories of saves that never finished (a kill during a save): never
    a checkpoint (`latest` names only published ones), so nothing is lost. Returns their paths. One
    process calls it."""
    gone = []
    if os.path.isdir(save_dir):
        for old in sorted(os.listdir(save_dir)):
            if old.startswith(".") and ".tmp-" in old:
                shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
                gone.append(os.path.join(save_dir, old))
    return gone


def save(e, save_dir, tag=None, client_state=None, save_latest: bool = True) -> str:
    """Every rank writes its part; returns the checkpoint's directory. A collective. save_latest
    False (DeepSpeed's switch) leaves `latest` naming the previous checkpoint."""
    acc = e.gradient_accumulation_steps()
    if e.micro_steps % acc:
        raise CheckpointError(f"save_checkpoint in the middle of gradient accumulation (micro-step "
                              f"{e.micro_steps % acc} of {acc}): the accumulated gradients are not "
                              "saved; save right after a step() that stepped")
    tag = str(tag if tag is not None else f"global_step{e.global_steps}")
    if not tag or tag.startswith(".") or os.sep in tag:
        raise CheckpointError(f"tag {tag!r} must be a plain name (no '{os.sep}', not starting with "
                              "'.')")
    comm, rank, save_dir = e.comm, e.comm.rank, os.path.abspath(save_dir)
    tmp = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            remove_interrupted_saves(save_dir)
            tmp = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir)
        except OSError as ex:
            tmp = OSError(f"cannot write into {save_dir}: {ex}")
    tmp = comm.allgather_object(tmp)[0]  # every rank learns the directory, or the error: none hangs
    if isinstance(tmp, OSError):
        raise CheckpointError(str(tmp))
    path, info = os.path.join(tmp, f"rank{rank}.pt"), None
    try:
        rec = _record(e, client_state)
        _write_atomic(path, lambda f: torch.save(rec, f))
        info = {"file": f"rank{rank}.pt", "bytes": os.path.getsize(path), "sha256": _sha256(path),
                "inventory": _inventory(e)}
    # (disk full, an unpicklable client_state: the others must hear)
    except Exception as ex:  # noqa: BLE001
        info = f"rank {rank} could not write {path}: {_failure(ex, save_dir)}"
    files = comm.allgather_object(info)
    bad = [f for f in files if isinstance(f, str)]
    # every rank gets here: all raise together, nothing is published and the partial save goes
    if bad:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(bad[0] + f"; the previous checkpoint in {save_dir} is untouched")
    if _interrupt is not None:
        _interrupt("before_publish")
    final, err = os.path.join(save_dir, tag), None
    if rank == 0:
        try:
            inventories = [f.pop("inventory") for f in files]
            _write_atomic(
                os.path.join(tmp, "meta.json"),
                lambda f: f.write(json.dumps(_meta(e, tag, inventories, files), indent=1).encode()),
            )
            aside = None
            if os.path.exists(final):
                aside = os.path.join(save_dir, f".{tag}.old-{uuid.uuid4().hex[:8]}")
                os.rename(final, aside)
            os.rename(tmp, final)
            if save_latest:
                _write_atomic(os.path.join(save_dir, "latest"), lambda f: f.write(tag.encode()))
            if aside:
                shutil.rmtree(aside, ignore_errors=True)
        except OSError as ex:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once it became `final`
            err = (f"could not publish {final}: {_failure(ex, save_dir)}; `latest` still names the "
                   "previous checkpoint")
    err = comm.allgather_object(err)[0]  # instead of a barrier: rank 0's failure reaches everyone
    if err:
        raise CheckpointError(err)
    return final


# ---------------------------------------------------------------------------- read and check
def _read(load_dir, tag=None):
    """-> (path, meta, [record per rank]), every file checked; raises CheckpointError."""
    load_dir = os.path.abspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            # a train run's folder: its checkpoints are one level down
            inner = os.path.join(load_dir, "checkpoints")
            hint = ("; this looks like a `minizero train` run folder: its checkpoints are in "
                    f"{inner}"
                    if os.path.isfile(os.path.join(inner, "latest")) else
                    " (pass tag=... to pick one, or check the directory)")
            raise CheckpointError(f"no checkpoint in {load_dir}: there is no 'latest' file{hint}")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as ex:
        raise CheckpointError(f"{path}: meta.json is missing or unreadable ({ex}); not a complete "
                              "minizero checkpoint") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    records = []
    for r, info in enumerate(meta["files"]):
        p = os.path.join(path, info["file"])
        if not os.path.isfile(p):
            raise CheckpointError(f"{path}: the shard of rank {r} of {meta['world_size']} "
                                  f"({info['file']}) is missing")
        size = os.path.getsize(p)
        if size != info["bytes"]:
            raise CheckpointError(f"{p} has {size} bytes, meta.json recorded {info['bytes']}: "
                                  "truncated or replaced")
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(f"{p}: checksum differs from meta.json: the file is corrupt")
        try:
            records.append(torch.load(p, map_location="cpu", weights_only=True))
        except Exception as ex:  # noqa: BLE001  (any unpickling failure means the same thing)
            raise CheckpointError(f"{p} cannot be read: {ex}") from None
    return path, meta, records


def _assemble(meta, records):
    """Full flat fp32 values per name ({name: {"master": t, state key: t}}) and scalar state."""
    shapes = {n: math.prod(s) for n, s in meta["params"]}
    full, scalars, cover = {}, {}, {}
    for rec in records:
        for name, pieces in rec["pieces"].items():
            if name not in shapes:
                raise CheckpointError(f"a shard holds parameter {name!r}, which meta.json does not "
                                      "list")
            for lo, hi, tensors in pieces:
                d = full.setdefault(name, {})
                if d and set(d) != set(tensors):
                    raise CheckpointError(f"the pieces of {name!r} hold different state "
                                          f"({sorted(d)} vs {sorted(tensors)})")
                for k, t in tensors.items():
                    d.setdefault(k, torch.zeros(shapes[name], dtype=t.dtype))[lo:hi] = t
                cover.setdefault(name, torch.zeros(shapes[name], dtype=torch.int32))[lo:hi] += 1
        scalars.update(rec["scalars"])
    for name, n in shapes.items():
        c = cover.get(name, torch.zeros(n, dtype=torch.int32))
        if not bool((c == 1).all()):
            raise CheckpointError(f"parameter {name!r}: {int((c > 0).sum())} of its {n} elements "
                                  f"are in the shards ({int((c > 1).sum())} more than once): the "
                                  "shards do not belong together")
    return full, scalars


def _check_model(e, meta, path, inventories):
    """The checkpoint holds this model, cut the same way over tp and pp (dp may differ: that
    reshards)."""
    mine, theirs = [[n, list(s)] for n, s in e.param_shapes], meta["model_params"]
    if mine != theirs:
        diff = next(((a, b) for a, b in zip(theirs, mine) if a != b), None)
        what = (f"first difference: {diff[0][0]!r} {diff[0][1]} there, {diff[1][0]!r} {diff[1][1]} "
                "here" if diff
                else f"{len(theirs)} trainable tensors there, {len(mine)} here")
        raise CheckpointError(f"{path} holds a different model "
                              f"({sum(math.prod(s) for _, s in theirs):,} trainable parameters "
                              f"there, {sum(math.prod(s) for _, s in mine):,} here; {what})")
    layout, saved = e.checkpoint_layout(), meta["layout"]
    for axis, word in (("tp", "tensor-parallel"), ("pp", "pipeline")):
        if layout[axis] != saved[axis]:
            raise CheckpointError(f"{path} was saved with {saved[axis]} {word} "
                                  f"rank{'s' * (saved[axis] != 1)} ({axis}), this job has "
                                  f"{layout[axis]}: a checkpoint reshards over data-parallel ranks "
                                  "only. Consolidate it (python -m minizero consolidate) and load "
                                  "the state dict into the model instead")
    keys = {k: s for k, s in _union(inventories, "keys")}
    if keys != {k: s for k, s in meta["params"]}:
        raise CheckpointError(f"{path}: its tensors ({len(meta['params'])}) are not the ones this "
                              f"job's ranks hold ({len(keys)}): saved from another model or "
                              "another cut")
    extras = {n: s for n, s, _ in _union(inventories, "extras")}
    if extras != {n: s for n, s, _ in meta["extras"]}:
        raise CheckpointError(f"{path}: the frozen parameters and buffers differ from this model's "
                              f"({sorted(n for n, _, _ in meta['extras'])} vs {sorted(extras)})")


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if torch.is_tensor(v) else v == b[k] for k, v in a.items()
    )


def _stateful(full, name) -> bool:
    return bool(set(full[name]) - {"master"})


def _plan(e, full, scalars):
    """The new (master, optimizer state) of every tensor this rank steps; touches nothing. A
    parameter saved without state (never stepped) gets zeros in a shared flat state, and none of its
    own."""
    plan = []
    for t, optim, segs, _ in _segments(e):
        names = [s[0] for s in segs]
        # a shard of padding only: state like any other
        ref = [n for n in names if _stateful(full, n)] or (
            [] if names else [n for n in full if _stateful(full, n)][:1])
        keys = {frozenset(full[n]) - {"master"} for n in ref}
        if len(keys) > 1 or any(
            not _same(scalars.get(ref[0], {}), scalars.get(n, {})) for n in ref
        ):
            raise CheckpointError(f"parameters {ref[:3]}... carry different optimizer state (e.g. "
                                  "Adam steps) and cannot share one flat shard here: load it with "
                                  "the stage it was saved with")
        master = torch.zeros(t.numel(), dtype=t.dtype)
        state = {
            k: torch.zeros(t.numel(), dtype=full[ref[0]][k].dtype)
            for k in (keys.pop() if keys else ())
        }
        for name, lo, hi, off, _ in segs:
            master[off:off + hi - lo] = full[name]["master"][lo:hi]
            for k, v in state.items():
                if _stateful(full, name):
                    v[off:off + hi - lo] = full[name][k][lo:hi]
        state = {k: v.view(t.shape).to(t.device) for k, v in state.items()}
        if ref:
            state.update({k: v.clone() if torch.is_tensor(v) else v for k,
                          v in scalars.get(ref[0], {}).items()})
        plan.append((t, optim, master.view(t.shape).to(t.device), state))
    return plan


def load(e, load_dir, tag=None, optimizer_states: bool = True, lr_scheduler_states: bool = True,
         module_only: bool = False):
    """-> (checkpoint path, client_state). A collective; see the module docstring. DeepSpeed's
    switches: optimizer_states False keeps this engine's optimizer state (the fp32 masters still
    load); module_only loads the masters alone (no optimizer state, scheduler, loss scale, counters
    or RNG: a warm start)."""
    optimizer_states = optimizer_states and not module_only
    rank, err = e.comm.rank, None
    inventories = e.comm.allgather_object(_inventory(e))
    try:
        path, meta, records = _read(load_dir, tag)
        _check_model(e, meta, path, inventories)
        full, scalars = _assemble(meta, records)
        plan = _plan(e, full, scalars)
    # every failure must reach the vote, or the others would hang
    except Exception as ex:  # noqa: BLE001
        err = str(ex) if isinstance(ex, CheckpointError) else f"{type(ex).__name__}: {ex}"
    errors = e.comm.allgather_object(err)
    for r, msg in enumerate(errors):
        if msg:
            by = "" if r == rank else f" (found by rank {r})"
            raise CheckpointError(f"{msg}{by}. Nothing was loaded: this engine's state is "
                                  "unchanged.")
    with torch.no_grad():
        for t, optim, master, state in plan:
            t.copy_(master)
            if optimizer_states:
                optim.state.pop(t, None)
                if state:
                    optim.state[t] = state
        e.strategy.after_load(
            lambda name: full[e.checkpoint_key(name)]["master"],
            (lambda name: _stateful(full, e.checkpoint_key(name))) if optimizer_states else None,
            e.param_names,
        )
        saved = {n: t for rec in records for n, t in rec["extras"].items()}
        for name, t in e.extras().items():
            t.copy_(saved[name])
    r0 = records[0]
    if module_only:
        return path, r0["client_state"]
    for k, v in r0["counters"].items():
        setattr(e, k, v)
    if e.loss_scaler is not None and r0["loss_scaler"] is not None:
        e.loss_scaler.load_state_dict(r0["loss_scaler"])
    if lr_scheduler_states and e.lr_scheduler is not None and r0["lr_scheduler"] is not None:
        e.lr_scheduler.load_state_dict(r0["lr_scheduler"])
    if meta["world_size"] == e.comm.size:
        torch.set_rng_state(records[rank]["rng"])
    return path, r0["client_state"]


# ---------------------------------------------------------------------------- full state dicts
def _state_dict(meta, full, extras) -> dict:
    """The plain model's state dict, fp32 (tied names share one tensor), in state_dict() order. With
    tensor parallelism each split parameter is put back together from its tp slices
    (tensor.layers.unshard)."""
    from minizero.tensor.layers import unshard
    shapes, local, out = {n: s for n, s in meta["model_params"]}, {k: s for k,
                                                                   s in meta["params"]}, {}
    tp, split = meta["layout"]["tp"], meta["layout"]["tp_split"]
    key = (lambda name, k: name) if tp == 1 else (lambda name, k: f"{name}@tp{k}")
    done = {}  # a tied weight's names share one tensor
    for sd_key in meta["state_dict_keys"]:
        name = meta["aliases"].get(sd_key, sd_key)
        if name in done:
            out[sd_key] = done[name]
        elif key(name, 0) in full:
            if name in split:
                dim, chunks = split[name]
                slices = [full[key(name, k)]["master"].view(local[key(name, k)]) for k in range(tp)]
                out[sd_key] = unshard(slices, dim, chunks)
            else:
                out[sd_key] = full[key(name, 0)]["master"].view(shapes[name])
            done[name] = out[sd_key]
        elif name in extras:
            out[sd_key] = (
                extras[name].float() if extras[name].is_floating_point() else extras[name].clone()
            )
        else:
            raise CheckpointError(f"state dict key {sd_key!r} is in no shard")
    return out


def _gathered(e):
    records, inventories = zip(*e.comm.allgather_object((_record(e), _inventory(e))))
    return _meta(e, None, inventories), list(records)


def gather(e):
    """(full values and optimizer state per key, scalar state) from every rank. A collective."""
    return _assemble(*_gathered(e))


def full_state_dict(e) -> dict:
    meta, records = _gathered(e)
    return _state_dict(meta, _assemble(meta, records)[0],
                       {n: t for r in records for n, t in r["extras"].items()})


def check_output(out) -> str:
    """consolidate's `out`: a file to write in a directory that exists; -> its absolute path."""
    out = os.path.abspath(out)
    if os.path.isdir(out):
        raise CheckpointError(f"{out} is a directory: pass the file to write, e.g. "
                              f"{os.path.join(out, 'model.pt')}")
    if not os.path.isdir(os.path.dirname(out)):
        raise CheckpointError(f"{os.path.dirname(out)} does not exist: create it, "
                              "or pass a file in a directory that does")
    return out


def consolidate(load_dir, out=None, tag=None) -> dict:
    """zero_to_fp32: the checkpoint's full fp32 state dict (written to `out` if given). No ranks
    needed."""
    out = check_output(out) if out else None  # before reading anything
    path, meta, records = _read(load_dir, tag)
    sd = _state_dict(meta, _assemble(meta, records)[0],
                     {n: t for r in records for n, t in r["extras"].items()})
    if out:
        try:
            _write_atomic(out, lambda f: torch.save(sd, f))
        except (OSError, RuntimeError) as ex:  # torch.save reports a full disk as a RuntimeError
            raise CheckpointError(
                f"could not write {out}: {_failure(ex, os.path.dirname(out))}"
            ) from None
    return sd
