"""Pipeline parallelism on real ranks: one 4-rank launch trains every schedule at p = 2 (x dp 2)
and p = 4 with m = 1, p, 2p micro-batches and checks, against measurements of that run,
  * the parameters after 5 SGD steps: one process on the whole batch (rtol 1e-6), torch DDP;
  * activations held per stage (the runtime's report to the memory ledger) vs the schedule's formula;
  * bytes sent per step (comm.stats, counted where sent) vs p2p theory + the tied all-reduce;
  * the measured timeline: each rank ran its action list, receives after the matching send.
Schedules as data (complete, deadlock-free, bubble formulas) are in test_pipeline_schedules.py."""
import pytest

from minizero import launch
from minizero_course.experiments.pipeline import GPT
from minizero.models import GPTConfig, TinyGPT
from minizero.pipeline import SCHEDULES, in_flight_formula, make_schedule

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

CONFIGS = [[name, p, m, 2 if name == "interleaved_1f1b" else 1, "ddp"]
           for name in SCHEDULES for p in (2, 4) for m in (1, p, 2 * p)]
CONFIGS += [["1f1b", 2, 4, 1, "zero1"], ["interleaved_1f1b", 2, 4, 2, "zero1"]]  # PP + ZeRO-1 over the dp axis
TOL = 2e-7  # atol at rtol 1e-6, as for DDP and ZeRO against one process (DESIGN.md §7)


@pytest.fixture(scope="module")
def launched():
    return launch.run("tests/pipeline_workers.py:suite", nprocs=4, args={"configs": CONFIGS}, timeout=300)


@pytest.fixture(scope="module")
def suite(launched):
    return [[rank["runs"][i] for rank in launched] for i in range(len(CONFIGS))], launched[0]["torch_ddp_params"]


def _label(run):
    c = run["config"]
    return f"{c['schedule']} p={c['p']} m={c['m']} v={c['v']} dp={c['dp']}"


def test_every_schedule_trains_like_one_process(suite):
    runs, _ = suite
    assert len(runs) == len(CONFIGS) == 26
    for ranks in runs:
        for r in ranks:
            ref = r["reference"]
            assert ref["atol_needed"] <= TOL, (f"{_label(r)}: rank {r['rank']} `{ref['param']}` is "
                                               f"{ref['max_diff']:.3g} from one process")
            if r["pp_rank"] == r["config"]["p"] - 1:  # the last stage reports the loss, the others None
                assert all(isinstance(loss, float) for loss in r["losses"])
            else:
                assert r["losses"] == [None] * 5


def test_dp_x_pp_equals_torch_ddp(suite):
    """1F1B on dp 2 x pp 2 (minizero DDP over the dp axis) against torch's DistributedDataParallel on
    the 4 ranks with the same global batch of 16: every parameter, the tied wte/lm_head included."""
    runs, torch_flat = suite
    model = TinyGPT(GPTConfig(**{**GPT, "n_layer": 2}))
    offsets, at = {}, 0
    for name, q in model.named_parameters():
        offsets[name] = (at, at + q.numel())
        at += q.numel()
    assert at == len(torch_flat)
    (ranks,) = [rs for rs, c in zip(runs, CONFIGS) if c == ["1f1b", 2, 4, 1, "ddp"]]
    seen = set()
    for r in ranks:
        for name, values in r["params"].items():
            lo, hi = offsets[name]
            worst = max(abs(a - b) - 1e-6 * abs(b) for a, b in zip(values, torch_flat[lo:hi]))
            assert worst <= TOL, f"rank {r['rank']}: `{name}` differs from torch DDP by {worst:.3g} (above rtol 1e-6)"
            seen.add(name)
    assert seen == set(offsets)  # the two stages hold the whole model between them


def test_activations_held_per_stage_match_the_schedule(suite):
    """The runtime meters the tensors autograd keeps for backward (memory.SavedTensors: each saved
    tensor is reported when autograd frees it) and reports the live bytes to memory.transient after
    every action. Peak count = the schedule's formula (GPipe m, 1F1B min(p-r, m), ...), and for
    GPipe and 1F1B the ledger's peak bytes = count x one micro-batch's bytes (the first and last
    stage's micro-batches differ by a few bytes: between count x the smallest and x the largest)."""
    runs, _ = suite
    exact = 0
    for ranks in runs:
        for r in ranks:
            c = r["config"]
            want = in_flight_formula(c["schedule"], c["p"], c["m"], r["pp_rank"], c["v"])
            assert r["peak_in_flight"] == [want] * 5, _label(r)
            sizes = sorted(set(r["activation_bytes"].values()))
            assert sizes[0] > 0
            if c["schedule"] in ("gpipe", "1f1b"):
                for peak in r["transient_peak"]:
                    assert want * sizes[0] <= peak <= want * sizes[-1], _label(r)
                exact += len(sizes) == 1 and r["transient_peak"] == [want * sizes[0]] * 5
    assert exact >= 8  # every middle stage, to the byte
    gpipe, one_f = (next(rs for rs, c in zip(runs, CONFIGS) if c[:3] == [n, 4, 8]) for n in ("gpipe", "1f1b"))
    assert [r["peak_in_flight"][0] for r in gpipe] == [8] * 4
    assert [r["peak_in_flight"][0] for r in one_f] == [4, 3, 2, 1]


def test_bytes_sent_are_p2p_theory_plus_the_tied_all_reduce(suite):
    """Per step a rank sends m·A per virtual stage it holds that is not the last (activations) and
    m·A per one that is not the first (gradients); the first and last stage all-reduce the tied
    embedding's gradient (2(N-1)/N·S, N = 2: S bytes); DDP over dp 2 all-reduces the stage's gradients."""
    runs, _ = suite
    for (_, _, _, _, dp_mode), ranks in zip(CONFIGS, runs):
        for r in ranks:
            c = r["config"]
            micro_bytes = 2 * GPT["block_size"] * GPT["n_embd"] * 4
            chunks = [k * c["p"] + r["pp_rank"] for k in range(c["v"])]
            last = c["p"] * c["v"] - 1
            want = c["m"] * micro_bytes * sum((s != last) + (s != 0) for s in chunks)
            assert r["p2p_theory"] == want
            assert r["tied_numel"] == (GPT["vocab_size"] * GPT["n_embd"] if r["pp_rank"] in (0, c["p"] - 1) else 0)
            tied = 4 * r["tied_numel"]
            if dp_mode == "zero1":  # (N-1)/N of the padded flat gradient, then of the parameters, N = 2
                dp = {"reduce_scatter": 4 * r["padded_numel"] / 2, "all_gather": 4 * r["padded_numel"] / 2}
            else:  # DDP: 2(N-1)/N of the stage's gradients, N = 2
                dp = {"all_reduce": 4 * r["numel"] if c["dp"] == 2 else 0}
            for ops in r["sent_by_op"]:
                assert ops.get("send", 0) == want, _label(r)
                assert ops.get("all_reduce", 0) == tied + dp.get("all_reduce", 0), _label(r)
                for op in ("reduce_scatter", "all_gather"):
                    assert ops.get(op, 0) == dp.get(op, 0), _label(r)


def test_the_measured_timeline_is_the_schedule(suite):
    """Events are real per-rank start/stop times on one clock: each rank ran exactly its action list,
    actions do not overlap, and a stage starts computing F(k) only after the previous one did."""
    runs, _ = suite
    for ranks in runs:
        c = ranks[0]["config"]
        schedule = make_schedule(c["schedule"], c["p"], c["m"], c["v"])
        by_stage = {}
        for r in ranks:
            if r["dp_rank"]:
                continue
            for step in r["events"]:
                assert [e[0] for e in step] == [str(a) for a in schedule.actions[r["pp_rank"]]], _label(r)
                assert all(t0 <= t1 <= t2 for _, t0, t1, t2 in step)
                assert all(a[3] <= b[1] for a, b in zip(step, step[1:]))
            by_stage[r["pp_rank"]] = {e[0]: e for e in r["events"][-1]}
        for s in range(1, c["p"]):
            for k in range(c["m"]):
                assert by_stage[s][f"F{k}"][2] >= by_stage[s - 1][f"F{k}"][2], _label(ranks[0])


def test_verbose_prints_each_action_as_it_runs(launched):
    """verbose=True: one line per action, in the rank's order, with its wait, compute and the
    micro-batches held after it (ZB-H1: B keeps its micro-batch until W)."""
    schedule = make_schedule("zb_h1", 4, 2)
    for pp_rank, rank in enumerate(launched):  # p = 4 on 4 ranks: dp 1, pp rank = rank
        lines = rank["verbose"].splitlines()
        actions = schedule.actions[pp_rank]
        assert [line.split()[2] for line in lines] == [str(a) for a in actions], rank["verbose"]
        assert all(line.startswith(f"[pp {pp_rank}] ") and " wait " in line and " compute " in line for line in lines)
        held, want = [int(line.rsplit("held", 1)[1]) for line in lines], []
        for a in actions:
            want.append((want[-1] if want else 0) + {"F": 1, "B": 0, "W": -1}[a.kind])
        assert held == want, rank["verbose"]


def test_a_rank_dying_mid_pipeline_is_named_with_its_action():
    """Rank 1 is SIGKILLed (no traceback) in the forward of micro-batch 2: the job ends by itself,
    before its timeout (a LaunchError, not a LaunchTimeout), naming the rank and its pipeline action."""
    with pytest.raises(launch.LaunchError) as e:
        launch.run("tests/pipeline_workers.py:dies_mid_pipeline", nprocs=2, timeout=120)
    assert not isinstance(e.value, launch.LaunchTimeout), str(e.value)
    msg = str(e.value).splitlines()[0]
    assert msg.startswith("rank 1 died without a Python traceback"), msg
    assert "during pipeline action F2 on stage 1" in msg.split("The other ranks")[0], msg


def test_engine_with_a_pipeline_section_trains_like_one_process(launched):
    """minizero.initialize with pipeline.stages = 2 on 4 ranks (dp 2): ZeRO-0 (DDP over dp) with 1F1B,
    ZeRO-1 with ZB-H1 and with interleaved 1F1B, SGD and gradient clipping at 0.05 (active: the norms
    are ~1): parameters, losses and the global gradient norm equal one process clipping with
    torch.nn.utils.clip_grad_norm_ (the tied embedding counted once)."""
    for rank in launched:
        for run in rank["engine"]:
            assert run["atol_needed"] <= TOL, run["config"]
            assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-6)  # on every rank, every stage
            assert run["norms"] == pytest.approx(run["ref_norms"], rel=1e-6)
            assert min(run["ref_norms"]) > 0.5


def test_activation_checkpointing_in_the_pipeline_engine_changes_memory_not_results(launched):
    """DeepSpeed's activation_checkpointing section with pipeline.stages 2: every schedule (ZB-H1's W
    recomputes a second time) and 1F1B with tp 2 end with this rank's parameters bitwise those of the
    same run without it, the same losses, and fewer bytes held for backward (each block keeps its input)."""
    for rank in launched:
        runs = rank["checkpointing"]
        for plain, ckpt in zip(runs[0::2], runs[1::2]):
            assert (plain["checkpointing"], ckpt["checkpointing"]) == (False, True)
            assert ckpt["checkpointed"] == 4 and plain["checkpointed"] == 0, ckpt["layout"]
            assert ckpt["params"] == plain["params"] and ckpt["losses"] == plain["losses"], ckpt["layout"]
            assert ckpt["peak_activation_bytes"] < 0.7 * plain["peak_activation_bytes"], (
                ckpt["layout"], ckpt["peak_activation_bytes"], plain["peak_activation_bytes"])


@pytest.mark.parametrize("nprocs", [4, 8])
def test_3d_dp_pp_tp_with_zero1_trains_like_one_process(nprocs):
    """minizero.initialize with pipeline.stages 2 and tensor_parallel.autotp_size 2: pp 2 x tp 2 on 4
    ranks, dp 2 x pp 2 x tp 2 on 8. ZeRO-1 (1F1B, interleaved 1F1B; tied embedding) and ZeRO-0 (GPipe),
    SGD with momentum and gradient clipping at 0.05 (active: the norms are ~1). After 5 steps every rank's
    stage, gathered over its tp group, equals one process on the whole batch at rtol 1e-6; the losses and
    the global gradient norm equal one process's on every rank. The bytes each rank sent in a step equal
    the planner's prediction for its stage (GPipe and 1F1B: the schedules the planner models)."""
    ranks = launch.run("tests/pipeline_workers.py:three_d_runs", nprocs=nprocs, timeout=400)
    coords = sorted(tuple(rank[0]["coords"]) for rank in ranks)
    assert coords == sorted((d, p, t) for d in range(nprocs // 4) for p in range(2) for t in range(2))
    for rank in ranks:
        for run in rank:
            assert run["atol_needed"] <= TOL, (run["coords"], run["config"])
            assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-6)
            assert run["norms"] == pytest.approx(run["ref_norms"], rel=1e-6)
            assert min(run["ref_norms"]) > 0.5
            # each stage checked every tensor it holds: the first has wte and wpe, the last ln_f and lm_head
            names = run["checked"]
            assert ("wte.weight" in names) == (run["coords"][1] == 0 or run["config"][2])
            assert ("ln_f.weight" in names) == (run["coords"][1] == 1)
            assert sum(n.startswith("h.") for n in names) == 24  # 2 of the 4 blocks, 12 tensors each
            if run["planned_sent"] is not None:  # the planner (minizero/planner) never saw this run
                # the engine's one-element collectives (the loss broadcast to every stage, the gradient
                # norm's all-reduces) are not in the plan: at most 4 of them, 16 bytes
                extra = run["sent"] - sum(run["planned_sent"].values())
                assert 0 <= extra <= 16, (run["coords"], run["config"], run["sent"], run["planned_sent"])


def test_3d_bytes_by_group_and_link_on_8_ranks_as_two_nodes():
    """minizero_course/experiments/three_d.py (lesson 11, `bench 3d`): dp 8 and dp 2 x pp 2 x tp 2, both ZeRO-1, on 8
    ranks as 2 simulated nodes of 4, one global batch. Every rank's bytes per group equal the planner's for its
    stage up to the engine's one-element collectives; in 3D the dp bytes are exactly what crosses nodes (tp and
    pp pairs sit inside a node); in the dp ring only the last rank of each node sends across, all of its
    bytes; both layouts give the same losses."""
    ranks = launch.run("minizero_course.experiments.three_d:run", nprocs=8, timeout=400, args={"steps": 1})
    for rank, (dp8, three_d) in enumerate(ranks):
        for r in (dp8, three_d):
            for group, planned in r["planned"]["by_group"].items():
                assert 0 <= r["sent"]["by_group"][group] - planned <= 16, (rank, r["layout"]["name"], group)
            assert 0 <= r["sent"]["by_group"]["other"] <= 16, (rank, r["layout"]["name"])
            assert r["losses"] == pytest.approx(ranks[0][0]["losses"], rel=1e-5)
        d, p, t = three_d["coords"]
        assert rank == (d * 2 + p) * 2 + t
        extra = three_d["sent"]["by_link"]["cross-node"] - three_d["sent"]["by_group"]["dp"]
        assert 0 <= extra <= three_d["sent"]["by_group"]["other"], rank  # tp and pp: not one byte across
        assert three_d["sent"]["by_group"]["tp"] > 0 and three_d["sent"]["by_group"]["pp"] > 0
        links = three_d["planned"]["link"]
        assert (links["dp"], links["tp"], links["pp"]) == ("cross-node", "intra-node", "intra-node")
        crossed = dp8["sent"]["by_link"]["cross-node"]
        assert crossed == (sum(dp8["sent"]["by_group"].values()) if rank in (3, 7) else 0), rank


# ----------------------------------------------------------------------------- PP + ZeRO-2/3 (experiments.pp_zero)
def _pp_zero(launched):
    """{(mode, tie): [the run on each rank]} of the shared launch's dp 2 x pp 2 measurement."""
    out = {}
    for rank in launched:
        for run in rank["pp_zero"]:
            out.setdefault((run["mode"], run["tie"]), []).append(run)
    return out


def test_pp_zero_bytes_reduce_every_micro_batch_m_times(launched):
    """ZeRO-2 reducing inside every micro-batch's backward sends m x the gradient bytes of the same ZeRO-2
    reducing once per step (no_sync), which sends what ZeRO-1's one reduce-scatter sends; ZeRO-3 reduce-
    scatters m times and all-gathers the weights about 2m times (a unit whose backward reads no weight is
    not gathered again), against ZeRO-1's one all-gather."""
    runs = _pp_zero(launched)
    for rank in range(4):
        z1, once, every, z3 = (runs[(mode, tie)][rank] for mode, tie in (
            ("zero1", "full gradients"), ("zero2-once", "shards"), ("zero2-every", "shards"),
            ("zero3-every", "shards")))
        m, ops = every["m"], lambda r: r["sent_by_op"]
        assert ops(once)["reduce"] == ops(z1)["reduce_scatter"] > 0
        assert ops(every)["reduce"] == m * ops(once)["reduce"]
        assert ops(z3)["reduce_scatter"] == m * ops(z1)["reduce_scatter"]
        assert m * ops(z1)["all_gather"] < ops(z3)["all_gather"] <= 2 * m * ops(z1)["all_gather"]
        assert ops(every)["send"] == ops(z1)["send"] == ops(z3)["send"]  # the pipeline's own bytes do not change


def test_pp_zero_memory_orders_as_the_shards_say(launched):
    """Peak model states over a step (ledger after every pipeline action): ZeRO-2 reducing once keeps ZeRO-1's
    full gradients AND its gradient shard (one shard more than ZeRO-1); reducing every micro-batch keeps only the
    shard (full - shard less than ZeRO-1); ZeRO-3 shards the parameters too."""
    runs = _pp_zero(launched)
    for rank in range(4):
        z1, once, every, z3 = (runs[(mode, tie)][rank]["states_peak"] for mode, tie in (
            ("zero1", "full gradients"), ("zero2-once", "shards"), ("zero2-every", "shards"),
            ("zero3-every", "shards")))
        numel = runs[("zero1", "full gradients")][rank]["numel"]
        shard = (once - z1)
        assert 0 < shard and 2 * shard >= 4 * numel  # a dp shard of the stage's fp32 gradient, padded
        assert z1 - every == 4 * numel - shard
        assert z3 < every < z1 < once


def test_pp_zero_trains_like_one_process_once_the_tied_shards_are_summed(launched):
    runs = _pp_zero(launched)
    for (mode, tie), ranks in runs.items():
        worst = max(r["max_diff"] for r in ranks)
        if tie == "none":  # the embedding's gradient lost its other half: far from one process
            assert worst > 1e-3, (mode, worst)
        else:
            assert worst < 1e-6, (mode, tie, worst)
