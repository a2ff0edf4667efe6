"""`mpirun -n 4 python -m minizero train --config cfg.json [more.json ...] [--model tiny-gpt]
[--steps N] [--out DIR]`

Trains a model with the engine and a DeepSpeed config, the loop a DeepSpeed user writes:

    for micro in range(accumulation):        # this rank's shard of each micro-batch
        loss = engine(x, y); engine.backward(loss); engine.step()

or, with a "pipeline" section (stages > 1), DeepSpeed's pipeline loop: loss =
engine.train_batch(data_iter), the accumulation steps being the pipeline's micro-batches.

and measures as it goes. In DIR (default runs/train):
  train_log.jsonl   one JSON object per optimizer step: global-batch loss, lr, the loss scale used,
                    whether the step was skipped, step time, bytes this rank sent (comm.stats),
                    the ledger's bytes by category (rank 0), gradient norm when clipping
  loss.png          the loss curve (and the lr), skipped steps marked
  checkpoints/      with --save-every K; --resume continues from the latest one (same data order:
                    the batches of step s are a pure function of the seed and s); no checkpoint is
                    an error, unless --resume-if-exists (then it starts from step 0)
and prints a progress bar (rank 0) and a final summary table (memory of every rank).
The config's "seed" seeds the model's init and the data; its "model" names the model (--model
overrides it) and "zero_init": true builds it under minizero.zero.Init (minizero extras, see
runtime/config.py). Several configs train one after the other in the same processes (one launch),
each in DIR/<config name>.

Bad input is said once and changes nothing: every check that needs no other rank runs first, on
every rank alike (preflight), and rank 0 reports it; a rank that fails later prints one message for
the job and the job ends (comm/watchdog.py: end_job), as it does when a rank stops making progress
in a collective for MINIZERO_WATCHDOG_S seconds (default 300). Exit code 2: your input; 1: a bug.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from minizero import comm as comm_mod
from minizero.comm import watchdog
from minizero.precision import MinLossScaleError
from minizero.runtime.checkpoint import CheckpointError
from minizero.runtime.config import ConfigError, load_config
from minizero.runtime.resolve import resolve
from minizero.data import SyntheticTokens, regression_batch, shard
from minizero.models import MODELS, build_model


def batches(name, model, seed):
    """(step, batch_size) -> the global (x, y) of that micro-step: tokens, or regression pairs for
    mlp."""
    if name == "mlp":
        return lambda s, b: regression_batch(s, b, model.sizes[0], model.sizes[-1], seed=seed)
    vocab = getattr(model, "vocab_size", None) or model.config.vocab_size
    block = getattr(model, "block_size", None) or model.config.block_size
    return SyntheticTokens(vocab, block, seed=seed).batch


def build(model_name, cfg):
    """The model a config asks for: `model_name` (or the config's "model"), seeded by its "seed",
    built under zero.Init when it says "zero_init": true (each rank then materializes only its
    shards)."""
    name = model_name or cfg["model"]
    if name not in MODELS:  # --model is checked by argparse; the config's key here
        raise ConfigError(f"model {name!r} is not one of {', '.join(sorted(MODELS))}")
    if not cfg["zero_init"]:
        return build_model(name, seed=cfg["seed"])
    from minizero.zero.init import Init
    with Init():
        return build_model(name, seed=cfg["seed"])


def notes(engine) -> list[str]:
    """What the summary must say when a setting did nothing at this model size."""
    largest = engine.strategy.unsharded_largest()
    if largest is None:
        return []
    zero = engine.config["zero_optimization"]
    extra = (" ZeRO++ (qwZ, hpZ, qgZ) acts on sharded parameters only, so it did nothing either."
             if getattr(engine.wrapped, "quantized_weights", None) is not None else "")
    return [f"nothing is sharded: every tensor is below stage3_param_persistence_threshold = "
            f"{int(zero['stage3_param_persistence_threshold']):,} elements (the largest has "
            f"{largest:,}), so every rank holds the whole model and all-reduces its gradients, as "
            f"DDP does. Set the threshold below {largest:,} (or train a larger model) to "
            f"shard.{extra}"]


class NonFiniteLoss(ValueError):
    """The global-batch loss is nan or inf at a step that was applied (fp32, bf16: nothing skips
    it)."""


def nonfinite_message(step: int, loss: float, lr: float, dtype) -> str:
    return (f"step {step}: the global-batch loss is {loss} and the step was applied: in "
            f"{str(dtype).replace('torch.', '')} "
            "no loss scaler skips a step (fp16's does, as DeepSpeed's), so the weights are no "
            f"longer finite and every later step would be {loss} too. Likely causes: a learning "
            f"rate far too large (lr was {lr:g}), no gradient_clipping, or inputs out of range")


def train(comm, config, model_name=None, steps=50, out="runs/train", save_every=0, resume=False,
          progress=True, on_nonfinite="stop"):
    """Runs on every rank. Returns the per-step log records (rank 0's view) and this rank's ledger.
    on_nonfinite: a nan/inf loss at an applied step is reported at that step; "stop" then ends the
    run (its step is logged), "continue" goes on (said once)."""
    from minizero.runtime.engine import build_engine
    # a path, or the config preflight checked (its warnings said once)
    cfg = load_config(config, comm.size)
    seed = cfg["seed"]
    model = build(model_name, cfg)
    # before ZeRO-3 moves them into flat shards
    n_params = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, cfg, comm)  # a bad config raises here, before any collective
    batch_of = batches(model_name or cfg["model"], model, seed)
    micro, acc = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rank, size = comm.rank, comm.size
    ckpt = os.path.join(out, "checkpoints")
    if resume and os.path.exists(os.path.join(ckpt, "latest")):
        engine.load_checkpoint(ckpt)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        path, kept = os.path.join(out, "train_log.jsonl"), []
        # drop steps logged after the checkpoint: they are redone
        if resume and os.path.exists(path):
            with open(path) as f:
                kept = [
                    line
                    for line in f
                    if line.strip() and json.loads(line)["step"] <= engine.global_steps
                ]
        log = open(path, "w")
        log.writelines(kept)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=engine.global_steps,
                   desc=f"{describe(engine)} on {size} rank{'s' * (size != 1)}",
                   file=sys.stdout, mininterval=0.2)
    records = []
    while engine.global_steps < steps:
        # as used
        lr, scale, sent0, t0 = engine.lr, engine.loss_scale, comm.stats.sent(), time.perf_counter()
        moved0 = engine.offload_traffic()
        # the data-parallel ranks split the batch; the tp ranks of one group (and a pipeline's
        # stages) see the same rows
        micro_batches = (shard(batch_of(engine.global_steps * acc + i, micro * engine.dp_size),
                               engine.dp_rank, engine.dp_size) for i in range(acc))
        # a pipeline: the m micro-batches in one call; every rank gets the mean
        if hasattr(engine, "train_batch"):
            mean = engine.train_batch(micro_batches).detach().float().reshape(1)
            dt, sent = time.perf_counter() - t0, comm.stats.sent() - sent0
        else:
            losses = []
            for x, y in micro_batches:
                loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().float())
            dt, sent = time.perf_counter() - t0, comm.stats.sent() - sent0
            mean = torch.stack(losses).mean().reshape(1)
            # the global batch's loss (after `sent` was read: not training traffic)
            comm.all_reduce(mean, op="avg")
        ledger = engine.memory()
        rec = {"step": engine.global_steps, "loss": mean.item(), "lr": lr, "loss_scale": scale,
               "skipped": not engine.was_step_applied(), "step_time_s": dt, "sent_bytes": sent,
               "memory": ledger.by_category, "transient_peak": ledger.transient_peak,
               "grad_norm": engine.get_global_grad_norm()}
        if moved0:  # offload: bytes this rank moved between device, host and disk in this step
            rec["offload_bytes"] = {k: v - moved0[k] for k, v in engine.offload_traffic().items()}
            rec["memory_by_location"] = ledger.by_location
        if engine.config["wall_clock_breakdown"]:
            rec["timings"] = dict(engine.timings)
        records.append(rec)
        # every rank holds the same global-batch mean: they all decide alike, with no collective
        bad = not math.isfinite(rec["loss"]) and not rec["skipped"]
        if bad and on_nonfinite == "stop":
            if rank == 0:
                log.write(json.dumps(rec) + "\n")
                log.close()
            raise NonFiniteLoss(
                nonfinite_message(rec["step"], rec["loss"], lr, engine.dtype)
                + ". The run stops here "
                "(its log ends with this step); --on-nonfinite continue would go on"
            )
        if (
            bad
            and rank == 0
            and not any(not math.isfinite(r["loss"]) and not r["skipped"] for r in records[:-1])
        ):
            print("\nminizero train: warning: "
                  f"{nonfinite_message(rec['step'], rec['loss'], lr, engine.dtype)}. Going on "
                  "(--on-nonfinite continue)", file=sys.stderr, flush=True)
        if save_every and engine.global_steps % save_every == 0:
            engine.save_checkpoint(ckpt)
        if rank == 0:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}",
                                scale=f"{scale:g}")
            elif engine.global_steps % engine.config["steps_per_print"] == 0:
                print(f"step {engine.global_steps}: loss {rec['loss']:.4f} lr {rec['lr']:.3e}",
                      flush=True)
    if bar:
        bar.close()
    if rank == 0:
        log.close()
    return {"records": records, "ledger": engine.memory().as_dict(), "rank": rank,
            "n_params": n_params, "stage": engine.stage, "layout": describe(engine),
            "dtype": str(engine.dtype).replace("torch.", ""), "world": size,
            "batch": (micro, acc, engine.train_batch_size()), "skipped": engine.skipped_steps,
            "notes": notes(engine)}


def describe(engine) -> str:
    """ "ZeRO stage 1", with the mesh when there is one: "ZeRO stage 1, dp 2 x pp 2 x tp 2"."""
    mesh = engine.mesh
    if mesh is None:
        return f"ZeRO stage {engine.stage}"
    extra = (f" x cp {mesh.cp_size}" if mesh.cp_size > 1 else "") + (
        f", ep {mesh.ep_size}" if mesh.ep_size > 1 else ""
    )
    return (f"ZeRO stage {engine.stage}, dp {mesh.dp_size} x pp {mesh.pp_size} x tp "
            f"{mesh.tp_size}{extra}")


def summary(result, ledgers, out=sys.stdout):
    recs = result["records"]
    micro, acc, total = result["batch"]
    dp = total // (micro * acc)
    print(f"\nminizero train: {result['n_params']:,} parameters, {result['layout']}, "
          f"{result['dtype']}, {result['world']} rank{'s' * (result['world'] != 1)}, {micro} x "
          f"{acc} accumulation x {dp} "
          f"{('rank' if dp == 1 else 'ranks') if dp == result['world'] else 'data-parallel ranks'} "
          f"= {total} per step",
          file=out)
    if recs:
        times = [r["step_time_s"] for r in recs]
        print(f"steps {recs[0]['step']}..{recs[-1]['step']} ({result['skipped']} skipped): "
              f"loss {recs[0]['loss']:.4f} -> "
              f"{recs[-1]['loss']:.4f}, median step {statistics.median(times) * 1e3:.1f} ms, sent "
              f"per step {statistics.median(r['sent_bytes'] for r in recs) / 1e6:.3f} MB (rank 0)",
              file=out)
    cats = ["parameters", "master_params", "gradients", "optimizer_state", "buffers"]
    print(f"{'rank':>4} | " + " | ".join(f"{c[:14]:>14}" for c in cats) + f" | {'total':>8} | "
                                                                          f"{'transient':>9}  (MB)",
          file=out)
    for r, led in enumerate(ledgers):
        cat = led["by_category"]
        print(f"{r:>4} | " + " | ".join(f"{cat[c] / 1e6:>14.3f}" for c in cats) +
              f" | {led['total'] / 1e6:>8.3f} | {led['transient_peak'] / 1e6:>9.3f}", file=out)
    for note in result.get("notes", []):
        print(f"note: {note}", file=out)
    if recs and "offload_bytes" in recs[-1]:
        loc, moved = recs[-1]["memory_by_location"], recs[-1]["offload_bytes"]
        print("offload (rank 0, last step): held " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k,
                                                               v in loc.items())
              + "; moved " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in moved.items()), file=out)


MAX_DRAWN_LR = 1e30  # a larger lr is named in the legend, not drawn


def plot(records, path, title="minizero train"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    # matplotlib leaves nan/inf out
    ax.plot(steps, [r["loss"] for r in records], marker=".", label="global-batch loss")
    bad = [r["step"] for r in records if not math.isfinite(r["loss"]) and not r["skipped"]]
    if bad:
        ax.axvline(bad[0], color="r", ls="--", label=f"loss not finite from step {bad[0]}")
    skipped = [r for r in records if r["skipped"]]
    if skipped:
        ax.scatter([r["step"] for r in skipped], [r["loss"] for r in skipped], color="r", zorder=3,
                   label="skipped (fp16 overflow)")
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    lr = ax.twinx()
    lrs = [r["lr"] for r in records]
    if max(lrs) <= MAX_DRAWN_LR:
        lr.plot(steps, lrs, color="gray", ls=":", label="learning rate (right)")
    else:  # an absurd lr (1e308): matplotlib's axis margins and ticks overflow
        lr.plot([], [], color="gray", ls=":",
                label=f"learning rate: up to {max(lrs):.3g}, not drawn")
    lr.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + lr.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class UsageError(ValueError):
    """A command-line input that cannot work (said once, before any rank does anything)."""


USER_ERRORS = (ConfigError, CheckpointError, UsageError, MinLossScaleError, ValueError, TypeError,
               OSError)


def preflight(args, world_size: int):
    """Every check that needs no other rank, made alike by every rank before any collective, so a
    bad input fails once, at once: the arguments, the config (JSON, keys, types, values, what the
    engine can do), --resume's checkpoint, the output directory. The checked configs go to
    args.checked."""
    args.checked = {}
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.save_every < 0:
        raise UsageError("--save-every must be 0 (never) or a number of steps, got "
                         f"{args.save_every}")
    for config, out in runs(args):
        if not os.path.isfile(config):
            raise UsageError(f"config file {config!r} not found (see configs/ for examples)")
        try:
            cfg = args.checked[config] = load_config(config, world_size)
            resolve(cfg, world_size, build(args.model, cfg))  # every rule build_engine() applies
        except ConfigError as e:  # with several configs, say which one
            if len(args.config) == 1 or str(e).startswith(config):
                raise
            raise ConfigError(f"{config}: {e}") from None
        latest = os.path.join(out, "checkpoints", "latest")
        if args.resume and not args.resume_if_exists and not os.path.exists(latest):
            raise UsageError(f"--resume: no checkpoint to resume from ({latest} does not exist). "
                             "Check --out, or pass --resume-if-exists to start from step 0 when "
                             "there is none")
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {out!r}: cannot create it ({e.strerror})") from None


def runs(args) -> list[tuple[str, str]]:
    """(config, output folder) for each config: one config writes to --out, several to --out/<config
    name>."""
    if len(args.config) == 1:
        return [(args.config[0], args.out)]
    stems = [os.path.splitext(os.path.basename(c))[0] for c in args.config]
    if len(set(stems)) < len(stems):
        raise UsageError("--config: two configs have the same file name; each one's output goes to "
                         "--out/<name>, so give them different names")
    return [(c, os.path.join(args.out, stem)) for c, stem in zip(args.config, stems)]


def main(argv=None) -> int:
    from minizero.cli import checks
    ap = checks.Parser(prog="minizero train",
                       description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--config", required=True, nargs="+",
                    help="a DeepSpeed JSON config (see configs/); several train one after the "
                         "other in one launch")
    ap.add_argument("--model", default=None, choices=sorted(MODELS),
                    help="the model (default: the config's "
                    "\"model\", else tiny-gpt)")
    ap.add_argument("--steps", type=int, default=50,
                    help="optimizer steps in all (a resumed run counts from 0)")
    ap.add_argument("--out", default="runs/train",
                    help="log, plot and checkpoints go here (several configs: "
                    "OUT/<config name>)")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: never)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/checkpoints/latest (an error if none)")
    ap.add_argument("--resume-if-exists", action="store_true",
                    help="continue from OUT/checkpoints/latest if there is one, else start from "
                         "step 0")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--on-nonfinite", choices=("stop", "continue"), default="stop",
                    help="a nan/inf loss at an applied step (fp32, bf16) is reported at that step; "
                         "then stop (the default, exit 2) or continue. fp16's loss scaler skips "
                         "such steps itself")
    args = ap.parse_args(argv)
    args.resume = args.resume or args.resume_if_exists
    rank = comm_mod.launched_rank()
    try:
        preflight(args, comm_mod.launched_world_size())
    # every rank found it, before any collective: rank 0 says it
    except (ConfigError, UsageError) as e:
        if rank == 0:
            print(f"minizero train: {e}", file=sys.stderr)
        return 2
    # a save killed midway left its .TAG.tmp-* directory: never a checkpoint, so it goes, said once
    if rank == 0:
        from minizero.runtime.checkpoint import remove_interrupted_saves
        for path in (
            p
            for _, out in runs(args)
            for p in remove_interrupted_saves(os.path.join(out, "checkpoints"))
        ):
            print(f"minizero train: removed {path}, left by a save that was interrupted (never a "
                  "checkpoint: `latest` names the last complete one)", file=sys.stderr)
    try:
        comm = comm_mod.init()
    except RuntimeError as e:  # a rendezvous that did not complete: each rank that waited says so
        print(f"minizero train: {e}", file=sys.stderr)
        return 2
    # a rank stuck in a collective ends the job (MINIZERO_WATCHDOG_S, default 300 s)
    watchdog.start(comm)
    if comm.size == 1:
        print("minizero train: running on 1 rank; for N ranks start it with `mpirun -n N python -m "
              "minizero train ...` (or `torchrun --nproc_per_node N -m minizero train ...`)",
              file=sys.stderr)
    todo = runs(args)
    for i, (config, out) in enumerate(todo):
        if comm.rank == 0 and len(todo) > 1:
            print(f"\n=== config {i + 1}/{len(todo)}: {config}", flush=True)
        run_one(comm, args, config, out)
    return 0


def run_one(comm, args, config, out):
    """Train one config on every rank; rank 0 prints its summary and draws its loss curve."""
    try:
        result = train(comm, args.checked.get(config, config), args.model, args.steps, out,
                       args.save_every, args.resume, not args.no_progress, args.on_nonfinite)
        ledgers = comm.allgather_object(result["ledger"])
    # one message for the job, from the first rank that failed, then the job ends
    except USER_ERRORS as e:
        watchdog.end_job(comm, f"minizero train: rank {comm.rank}: {type(e).__name__}: {e}", 2)
    except Exception:  # noqa: BLE001  a bug, not an input: its traceback, once
        watchdog.end_job(comm,
                         f"minizero train: rank {comm.rank} failed:\n{traceback.format_exc()}", 1)
    if comm.rank == 0:
        summary(result, ledgers)
        log = os.path.join(out, "train_log.jsonl")
        with open(log) as f:  # the whole run, also the part before a --resume
            records = [json.loads(line) for line in f if line.strip()]
        if records:
            plot(records, os.path.join(out, "loss.png"),
                 f"minizero train: {os.path.basename(config)}, "
                 f"{result['layout']}, {result['dtype']}, {result['world']} "
                 f"rank{'s' * (result['world'] != 1)}")
            print(f"wrote {log} and {os.path.join(out, 'loss.png')}")
