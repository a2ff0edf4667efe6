"""Jobs started by hand, the way a course runs them: torchrun with no init_process_group, mpirun on
the train command and on lab files, plain python (one rank). Every bad input is said once and ends
the job with a non-zero code; a stopped rank ends the job through the watchdog, leaving no process.

Each test starts real processes (torchrun, mpirun, python): nothing here runs a collective in pytest.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from minizero import launch, zygote
from minizero_course.grader import LABS
from minizero.cli import train as train_cli
from minizero.data import regression_batch
from minizero_course.experiments.references import train_single
from minizero.models import build_model
from tests.machine import free_port, guard, retry_on_port_collision

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MLP_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}}


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(v, None)  # the test process's own launcher (if any) is not the job's
    return {**env, **extra}


def _run(cmd, timeout=240, **env):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=guard(timeout), cwd=ROOT,
                          env=_env(**env))


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(MLP_CONFIG))
    return path


def _first_loss(world, micro=4):
    """Step 1's global-batch loss, computed in this process: the MLP at init on the first global batch."""
    model = build_model("mlp", seed=0)
    x, y = train_cli.batches("mlp", model, 0)(0, micro * world)
    return model(x, y)[1].item()


# ---------------------------------------------------------------------------- torchrun
def test_torchrun_runs_the_train_command_and_a_plain_script_on_two_ranks(config, tmp_path):
    cmd = ["-m", "minizero", "train", "--config", str(config), "--model", "mlp", "--steps", "2",
           "--no-progress", "--out", str(tmp_path / "run")]
    # torchrun's default port, 29500, is every other job's; its torchelastic_* log folder lands in
    # TMPDIR
    two = [TORCHRUN, "--nproc_per_node", "2", "--master_port"]
    proc = retry_on_port_collision(lambda port: _run([*two, str(port), *cmd], TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("minizero train:") == 1 and "2 ranks" in proc.stdout, proc.stdout
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    # 2 ranks x 4 rows: the loss of the 8-row global batch (one rank alone would see 4 rows)
    assert log[0]["loss"] == pytest.approx(_first_loss(2), rel=1e-6)
    assert log[0]["loss"] != pytest.approx(_first_loss(1), rel=1e-6)
    # rank 1 starts 3 s past the rendezvous wait (6 s when idle, longer on a busy machine, where the
    # two ranks' imports end further apart): a collective may wait longer than the rendezvous
    # (gloo used the rendezvous timeout for every collective: "Timed out waiting 5999ms for recv")
    wait = guard(6)
    proc = retry_on_port_collision(lambda port: _run(
        [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(port), "tests/torchrun_script.py"],
        MINIZERO_INIT_TIMEOUT_S=f"{wait:.0f}", SLOW_RANK_S=f"{wait + 3:.0f}", TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the two ranks share one stdout: their lines may interleave, so read each JSON object after "RESULT "
    ranks = sorted((json.JSONDecoder().raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]),
                   key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["backend"]) for r in ranks] == [(0, 2, "torch"), (1, 2, "torch")]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["params"] == ranks[1]["params"]
    single = build_model("mlp", seed=0)  # the same 3 steps in one process on the full batches
    losses = train_single(single, torch.optim.SGD(single.parameters(), lr=0.1),
                          [regression_batch(s, 8, 16, 4) for s in range(3)])
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5)


def test_a_world_size_with_no_rendezvous_is_a_clear_error_within_the_timeout():
    """WORLD_SIZE=2 but only one process: rank 1 finds no server at MASTER_ADDR:MASTER_PORT, rank 0
    (a different job, another port) waits for a rank 1 that never comes. Both end with an error."""
    code = "from minizero import comm; comm.init()"
    ports = {r: free_port() for r in (0, 1)}  # nobody listens on either
    procs = {r: subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                                  MASTER_PORT=str(ports[r]),
                                                                  MINIZERO_INIT_TIMEOUT_S="3"))
             for r in (0, 1)}
    t0 = time.monotonic()
    for r, proc in procs.items():
        _, err = proc.communicate(timeout=guard(120))
        assert proc.returncode != 0
        assert f"rank {r} of 2: the torch.distributed rendezvous at MASTER_ADDR=127.0.0.1 MASTER_PORT={ports[r]} " \
               "did not complete within 3 s" in err, err[-2000:]
        assert "Are all 2 ranks started" in err
    assert time.monotonic() - t0 < guard(90)  # import time + 3 s, not torch's 30 minutes


# ---------------------------------------------------------------------------- the train command's inputs
@pytest.mark.parametrize("case", ["missing", "not_json", "wrong_type", "resume", "steps"])
def test_train_input_errors_are_one_message_before_anything_starts(case, config, tmp_path, capsys, monkeypatch):
    args = ["--config", str(config), "--model", "mlp", "--out", str(tmp_path / "run"), "--steps", "3"]
    if case == "missing":
        args[1], want = str(tmp_path / "nope.json"), "nope.json' not found"
    elif case == "not_json":
        config.write_text("{not json")
        want = "not valid JSON"
    elif case == "wrong_type":
        config.write_text(json.dumps({**MLP_CONFIG, "fp16": {"enabled": "false"}}))
        want = "'fp16.enabled' must be a boolean (true or false), got 'false' (str)"
    elif case == "resume":
        args, want = args + ["--resume"], "--resume: no checkpoint to resume from"
    else:
        args[-1], want = "0", "--steps must be at least 1"
    monkeypatch.delenv("PMI_RANK", raising=False)
    assert train_cli.main(args) == 2  # returns before any communicator exists: no collective here
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minizero train: ") and want in err[0], err
    monkeypatch.setenv("PMI_RANK", "1")  # the other ranks find the same error and say nothing
    assert train_cli.main(args) == 2
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


def test_train_on_one_rank_says_how_to_run_more_and_resume_if_exists_starts_fresh(config, tmp_path):
    proc = _run([sys.executable, "-m", "minizero", "train", "--config", str(config), "--model", "mlp", "--steps", "1",
                 "--no-progress", "--out", str(tmp_path / "run"), "--resume-if-exists"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = [line for line in proc.stderr.splitlines() if "running on 1 rank" in line]
    assert len(note) == 1 and "mpirun -n N python -m minizero train" in note[0]
    assert "1 rank, " in proc.stdout and "1 ranks" not in proc.stdout, proc.stdout  # one rank, said in the singular
    assert (tmp_path / "run" / "train_log.jsonl").exists()


def test_a_failure_after_start_is_one_message_and_a_non_zero_exit(config, tmp_path):
    """--resume from a checkpoint whose files are gone: every rank's load fails (they vote), the job
    prints one message, not one traceback per rank, and exits with 2."""
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step7")
    scratch = tmp_path / "tmp"  # where the job's heartbeat directory goes (tempfile follows TMPDIR)
    scratch.mkdir()
    proc = _run([launch.find_mpirun(), "-n", "2", sys.executable, "-m", "minizero", "train", "--config", str(config),
                 "--model", "mlp", "--steps", "9", "--no-progress", "--out", str(tmp_path / "run"), "--resume"],
                TMPDIR=str(scratch))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("CheckpointError") == 1 and "global_step7: meta.json is missing" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [p.name for p in scratch.iterdir() if p.name.startswith("minizero-job-")] == []  # removed, though os._exit


# ---------------------------------------------------------------------------- labs
def test_a_lab_stub_never_passes_on_one_rank_or_many():
    lab = "labs/lab01_ring_allreduce.py"
    one = _run([sys.executable, lab])  # no mpirun: one rank, and a note saying how to run four
    assert one.returncode == 2 and "max |ring" not in one.stdout, one.stdout + one.stderr
    assert "lab 1 on 1 rank: start it with `mpirun -n 4 python" in one.stderr
    assert one.stderr.count("lab 1: not implemented yet: phase 1, reduce-scatter") == 1, one.stderr
    many = _run([launch.find_mpirun(), "-n", "2", sys.executable, lab])
    assert many.returncode == 2 and many.stderr.count("not implemented yet") == 1, many.stderr
    assert "Traceback" not in many.stderr


@pytest.mark.parametrize("number", sorted(LABS))
def test_every_solution_runs_its_demo_as_a_student_would(number):
    """`mpirun -n N python solutions/labNN_*.py`, what a student runs first: the demo trains and prints its
    table on rank 0 and the job exits 0 (lab 02's once died at its last print on a renamed variable).
    mpirun starts the ranks, each forked from the session's zygote (`zygote.py script`: torch imported
    once, not by every rank of 14 jobs); the tests above and the watchdog's below run lab files cold."""
    lab = LABS[number]
    proc = _run([launch.find_mpirun(), "-n", str(lab.nprocs), sys.executable, zygote.__file__, "script",
                 f"solutions/{lab.filename}"], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) >= 2, proc.stdout  # the demo's table, printed once by rank 0


# ---------------------------------------------------------------------------- the watchdog
def _rank_pid(job, rank):
    for pid in launch.job_pids(job):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env:
            return pid
    return None


@pytest.mark.parametrize("what", ["train", "lab"])
def test_watchdog_ends_a_job_whose_rank_was_stopped(what, config, tmp_path):
    job, beats = uuid.uuid4().hex[:12], tmp_path / "beats"
    beats.mkdir()
    cmd = [launch.find_mpirun(), "-n", "2", sys.executable]
    cmd += ["-m", "minizero", "train", "--config", str(config), "--model", "mlp", "--steps", "1000000",
            "--no-progress", "--out", str(tmp_path / "run")] if what == "train" else ["solutions/lab02_bucketed_ddp.py"]
    # a rank of a busy machine may wait its turn for seconds: the watchdog's limit is scaled to it
    watchdog = f"{guard(3):.0f}"
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            env=_env(MINIZERO_WATCHDOG_S=watchdog, MINIZERO_JOB_ID=job,
                                     MINIZERO_HEARTBEAT_DIR=str(beats)))
    try:
        deadline = time.monotonic() + guard(120)
        while time.monotonic() < deadline:  # wait until rank 1 is busy with collectives
            beat = beats / "rank1.op"
            started = what != "train" or (tmp_path / "run" / "train_log.jsonl").exists()  # past start-up: stepping
            if started and beat.exists() and beat.read_text().strip() and _rank_pid(job, 1):
                break
            time.sleep(0.01)
        stopped = _rank_pid(job, 1)
        assert stopped, "rank 1 never reached a collective"
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=guard(90))
        took = time.monotonic() - t0
        time.sleep(0.5)
        left = launch.job_pids(job)
    finally:
        for pid in launch.job_pids(job):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"the watchdog left processes behind: {left}"
    assert proc.returncode != 0
    assert err.count(f"[minizero watchdog] no progress for {watchdog}s") == 1, err[-3000:]
    assert "rank 0 has been blocked in" in err and "rank 1 " in err and "STOPPED" in err, err[-3000:]
    assert took < guard(60), took  # 3 s of no progress, then the end: a deadlock guard, not speed
