"""Bad input from a careless user: every MINIZERO_* variable and command-line flag that cannot work is one line
naming it and what is allowed, exit code 2, before anything runs, nothing left behind, never a traceback.

The tables run the commands in this process (minizero.cli.main or minizero_course's main, output captured:
they fail before any launch); a few cases start real processes, once each, to see what a user sees: the
exit code of a job of 2 ranks, and that its ranks say the message once.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from minizero import cli, env
from minizero_course.grader import LABS
from minizero.cli import train as train_cli

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _env(**extra):
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", *env.VARIABLES):
        environ.pop(v, None)  # the test process's own launcher and settings are not the job's
    return {**environ, **extra}


def _mpirun(n, *args):
    from minizero import launch
    return [launch.find_mpirun(), "-n", str(n), sys.executable, *args]


# ---------------------------------------------------------------------------- environment variables
BAD_VARIABLES = [  # (variable, value, words of what is allowed)
    ("MINIZERO_WATCHDOG_S", "abc", "a number >= 0"),
    ("MINIZERO_WATCHDOG_S", "-5", "a number >= 0"),
    ("MINIZERO_WATCHDOG_S", "inf", "a number >= 0"),
    ("MINIZERO_INIT_TIMEOUT_S", "abc", "a number > 0"),
    ("MINIZERO_INIT_TIMEOUT_S", "0", "a number > 0"),
    ("MINIZERO_BACKEND", "bogus", "mpi or torch"),
    ("MINIZERO_BACKEND", "nccl", "mpi or torch"),
    ("MINIZERO_DEBUG", "yes", "0 or 1"),
    ("MINIZERO_HEARTBEAT_DIR", "/no/such/dir", "an existing directory"),
    ("MINIZERO_MAX_RANKS", "0", "a whole number >= 1"),
    ("MINIZERO_MULTINODE", "true", "0 or 1"),
    ("MINIZERO_TIMEOUT_SCALE", "0.5", "a number >= 1, or load"),
    ("MINIZERO_TIMEOUT_SCALE", "busy", "a number >= 1, or load"),
]
GOOD_VARIABLES = [("MINIZERO_WATCHDOG_S", "0", 0.0), ("MINIZERO_WATCHDOG_S", "2.5", 2.5),
                  ("MINIZERO_INIT_TIMEOUT_S", "6", 6.0), ("MINIZERO_BACKEND", "torch", "torch"),
                  ("MINIZERO_DEBUG", "1", True), ("MINIZERO_MAX_RANKS", "16", 16),
                  ("MINIZERO_MULTINODE", "0", False), ("MINIZERO_TIMEOUT_SCALE", "3", 3.0),
                  ("MINIZERO_TIMEOUT_SCALE", "load", "load")]


@pytest.mark.parametrize("name,value,allowed", BAD_VARIABLES)
def test_a_bad_variable_is_named_with_what_is_allowed(name, value, allowed, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(env.EnvError) as e:
        env.check()
    assert f"{name}={value!r}" in str(e.value) and allowed in str(e.value), str(e.value)


@pytest.mark.parametrize("name,value,parsed", GOOD_VARIABLES)
def test_a_good_variable_is_read_as_its_value(name, value, parsed, monkeypatch):
    monkeypatch.delenv("MINIZERO_TIMEOUT_SCALE", raising=False)  # the session's (tests/conftest.py)
    monkeypatch.setenv(name, value)
    assert env.get(name) == parsed and env.check() == {name: parsed}


def test_every_variable_the_package_reads_is_in_the_one_table():
    """No MINIZERO_* setting is read anywhere but minizero/env.py (launch.run's markers aside)."""
    import re
    markers = {"MINIZERO_JOB_ID", "MINIZERO_SCALE_PROBE"}
    read = set()
    for folder, _, files in (*os.walk(os.path.join(ROOT, "minizero")),
                             *os.walk(os.path.join(ROOT, "minizero_course"))):
        for f in files:
            if f.endswith(".py") and f != "env.py":
                text = open(os.path.join(folder, f)).read()
                read |= set(re.findall(r"environ(?:\.get)?\(?\[?[\"'](MINIZERO_\w+)", text))
                read |= set(re.findall(r"[\"'](MINIZERO_\w+)[\"'] (?:not )?in os\.environ", text))
    assert read <= markers, read - markers


@pytest.mark.parametrize("prog,argv", [("minizero", ["train", "--config", "configs/zero0_fp32.json"]),
                                       ("minizero_course", ["bench"]), ("minizero_course", ["grade"]),
                                       ("minizero", ["demo"]), ("minizero", ["plan", "--params", "7B"])])
def test_every_command_checks_the_variables_before_it_starts(prog, argv, monkeypatch, tmp_path, capsys):
    from minizero_course.__main__ import main as course_main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIZERO_DEBUG", "yes")
    main = cli.main if prog == "minizero" else course_main
    with pytest.raises(SystemExit) as e:
        main([argv[0], *[os.path.join(ROOT, a) if a.startswith("configs/") else a for a in argv[1:]]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "MINIZERO_DEBUG='yes'" in err and "0 or 1" in err, err
    assert err.startswith(f"{prog} {argv[0]}: ") and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["train", "user"])
def test_a_bad_variable_in_a_job_of_two_ranks_is_said_once(script, tmp_path):
    """Under mpirun: the train command, and a user's script whose first minizero call is comm.init(); each rank
    printed its own traceback."""
    if script == "user":
        (tmp_path / "user.py").write_text("from minizero import comm\ncomm.init()\nprint('started', flush=True)\n")
        cmd = _mpirun(2, str(tmp_path / "user.py"))
    else:
        cmd = _mpirun(2, "-m", "minizero", "train", "--config", "configs/zero0_fp32.json", "--out", str(tmp_path / "r"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=_env(MINIZERO_WATCHDOG_S="abc", TMPDIR=str(tmp_path)))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert text.count("MINIZERO_WATCHDOG_S='abc'") == 1 and "Traceback" not in text and "started" not in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == (["user.py"] if script == "user" else []), text


# ---------------------------------------------------------------------------- flags and files
CONFIGS = {"dup.json": '{"train_micro_batch_size_per_gpu": 8, "train_micro_batch_size_per_gpu": 4, '
                       '"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}',
           "huge.json": '{"train_micro_batch_size_per_gpu": 1e30, "optimizer": {"type": "Adam", "params": {"lr": 1}}}',
           "bad.json": '{"candidates": ',
           "notarun.json": '{"steps": 3}'}
BAD_FLAGS = [  # (argv, words the one line must hold)
    (["plan", "--params", "1e9", "--gpus", "8", "--fit", "80", "--pp", "2", "--zero", "3"], ["--fit", "--pp --zero"]),
    (["plan", "--params", "1e9", "--gpus", "8", "--fit", "80", "--schedule", "gpipe"], ["--fit", "--schedule"]),
    (["bench", "--trace", "tr", "--trace-steps", "-1"], ["--trace-steps", "got -1", "a whole number >= 1"]),
    (["bench", "--trace", "/proc/x"], ["--trace /proc/x", "cannot create it"]),
    (["bench", "--json", "no/such/dir/b.json"], ["--json no/such/dir/b.json", "does not exist"]),
    (["bench", "--nprocs", "0"], ["--nprocs", "got 0", "[1, 8]"]),
    (["bench", "--steps", "abc"], ["--steps", "'abc'", "a whole number >= 1"]),
    (["bench", "scale", "--ranks", "0"], ["--ranks", "got 0", "[1, 8]"]),
    (["bench", "scale", "--from-json", "missing.json"], ["--from-json missing.json", "cannot read it"]),
    (["bench", "scale", "--from-json", "bad.json"], ["--from-json bad.json", "not valid JSON"]),
    (["bench", "scale", "--from-json", "notarun.json"], ["--from-json notarun.json", "bench scale --json"]),
    (["bench", "scale", "--start", "9", "--stop", "4"], ["--stop 4", "--start 9"]),
    (["bench", "scale", "--timeout", "nan"], ["--timeout", "a number > 0"]),
    (["grade", "--json", "no/such/dir/results.json"], ["--json no/such/dir/results.json", "does not exist"]),
    (["grade", "--impl", "no_such_folder"], ["--impl no_such_folder", "no such folder"]),
    (["grade", "--lab", "99"], ["--lab 99", "1 (Ring all-reduce"]),
    (["grade", "--lab", "1", "--impl", "/etc"], ["--impl /etc", "holds none of the files", "lab01_"]),
    (["demo", "--steps", "0"], ["--steps", "got 0", "a whole number >= 1"]),
    (["consolidate", "/no/such", "out.pt"], ["DIR /no/such", "no such folder"]),
    (["gradescope", "--times", "no/such/dir/t.md"], ["OUT no/such/dir/t.md", "does not exist"]),
    (["gradescope", "--times", "t.md", "--lab", "99"], ["--lab 99", "the labs are 1-"]),
    (["gradescope", "bundle.txt"], ["OUT 'bundle.txt'", ".zip"]),
    (["gradescope", "b.zip", "--limit-s", "-3"], ["--limit-s", "a number > 0"]),
    (["handout", "/proc/x", "--labs", "1-3"], ["OUT '/proc/x'", "cannot make a folder in /proc"]),
    (["handout", "hh", "--labs", "0-99"], ["--labs '0-99'", f"no lab 0, {max(LABS) + 1}-99", "the labs are 1-"]),
    (["train", "--steps", "3"], ["minizero train: error:", "--config"]),
    (["train", "--config", "dup.json"], ["dup.json", "'train_micro_batch_size_per_gpu' given twice"]),
    (["train", "--config", "huge.json"], ["train_micro_batch_size_per_gpu", "[1, 1048576]"]),
]


@pytest.mark.parametrize("argv,words", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_or_key_is_one_line_exit_2_and_nothing_written(argv, words, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    for name, text in CONFIGS.items():
        (tmp_path / name).write_text(text)
    from minizero_course.__main__ import main as course_main
    try:  # the course's commands (bench, grade, ...) through `python -m minizero_course`'s dispatch
        code = (course_main if argv[0] in cli.COURSE_COMMANDS else cli.main)(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and all(w in err for w in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(CONFIGS), "something was written"


COURSE_TOOLS = [  # the course's own tools (docs/site, labgen, the Gradescope runner): (module, argv, words)
    ("docs.site.syllabus", ["measure", "--lessons", "99"], ["--lessons 99", "no such lesson", "0, 1, 2"]),
    ("docs.site.syllabus", ["measure", "--labs", "3", "99"], ["--labs 99", "no such lab"]),
    ("docs.site.build", ["--out", "/proc/x"], ["--out /proc/x", "cannot create it"]),
    ("minizero_course.grader.labgen", ["--lab", "99"], ["--lab 99", "no such lab"]),
    ("minizero_course.grader.gradescope", ["--root", "/no/such"], ["--root /no/such", "no submission/ folder"]),
    ("minizero_course.grader.gradescope", ["--root", ".", "--lab", "99"], ["--lab 99", "no such lab"]),
    ("minizero_course.grader.gradescope", ["--limit-s", "-3"], ["--limit-s", "a number > 0"]),
]


@pytest.mark.parametrize("module,argv,words", COURSE_TOOLS, ids=[f"{m} {' '.join(a)}" for m, a, _ in COURSE_TOOLS])
def test_the_course_tools_check_their_flags_before_any_work(module, argv, words, monkeypatch, tmp_path, capsys):
    """These tools run for minutes (measuring, grading, Sphinx): a bad flag is one line before any of it runs, and
    no measured times are written."""
    import importlib

    from docs.site import syllabus
    before = syllabus.TIMES.read_text()
    monkeypatch.setattr(syllabus, "measure", lambda *a: pytest.fail(f"measured {a}"))
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and all(w in err for w in words), err
    assert syllabus.TIMES.read_text() == before


def test_the_syllabus_measures_only_what_was_named(monkeypatch):
    from docs.site import syllabus
    asked = []
    monkeypatch.setattr(syllabus, "measure", lambda lessons, labs: asked.append((lessons, labs)))
    syllabus.main(["measure", "--labs", "3"])
    syllabus.main(["measure", "--lessons", "2", "4"])
    syllabus.main(["measure"])
    assert asked == [([], [3]), ([2, 4], []), (None, None)]


def test_the_commands_exit_2_in_a_real_process_without_a_traceback(tmp_path):
    """The in-process table above, as a user runs it: one case, the exit code and stderr of `python -m`."""
    proc = subprocess.run([sys.executable, "-m", "minizero_course", "bench", "scale", "--ranks", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env())
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- the library's entry point
@pytest.fixture
def world_of_one():
    """initialize() creates the communicator in this process: gone again after the test, since later tests
    check that a bad config fails before any communicator exists."""
    from minizero import comm as comm_mod
    assert not comm_mod.is_initialized()
    yield
    comm_mod.shutdown()


def test_the_tuple_of_initialize_called_as_an_engine_says_to_unpack_it(world_of_one):
    import minizero
    out = minizero.initialize(model=torch.nn.Linear(4, 4), config=MLP_CONFIG)
    with pytest.raises(TypeError, match=r"4-tuple.*engine, optimizer, _, _ = minizero.initialize"):
        out(torch.ones(4, 4))


def test_an_optimizer_built_on_another_model_is_named_as_such():
    import minizero
    from minizero.runtime.config import ConfigError
    other = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError) as e:
        minizero.initialize(model=torch.nn.Linear(4, 4), optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                            config={"train_micro_batch_size_per_gpu": 4})
    assert str(e.value).startswith("optimizer= was not built on model='s parameters") and \
        "model_parameters" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- a loss that is not finite
def _nan_config(tmp_path):
    path = tmp_path / "nan.json"
    path.write_text(json.dumps({**MLP_CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e308}}}))
    return path


def test_a_nan_loss_stops_the_job_at_its_step_said_once(tmp_path):
    """lr 1e308 in fp32: the loss was nan from step 2 without a word, and drawing loss.png then crashed."""
    out = tmp_path / "run"
    proc = subprocess.run(_mpirun(2, "-m", "minizero", "train", "--config", str(_nan_config(tmp_path)), "--model",
                                  "mlp",
                                  "--steps", "5", "--no-progress", "--out", str(out)),
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env(TMPDIR=str(tmp_path)))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    said = [line for line in text.splitlines() if "the global-batch loss is" in line]
    assert len(said) == 1 and "step 2: the global-batch loss is nan" in said[0] and "lr was 1e+308" in said[0], text
    assert "Traceback" not in text
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and steps[1]["loss"] != steps[1]["loss"]  # logged up to its step


def test_a_nan_loss_with_continue_is_said_once_and_drawn(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "minizero", "train", "--config", str(_nan_config(tmp_path)), "--model",
                           "mlp", "--steps", "4", "--no-progress", "--out", str(out), "--on-nonfinite", "continue"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("warning: step 2: the global-batch loss is nan") == 1, proc.stderr
    assert (out / "loss.png").stat().st_size > 1000


def test_the_loss_plot_draws_nan_losses_and_an_absurd_lr(tmp_path):
    records = [{"step": s, "loss": loss, "lr": 1e308, "skipped": False}
               for s, loss in ((1, 4.1), (2, float("nan")), (3, float("inf")))]
    train_cli.plot(records, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 1000


# ---------------------------------------------------------------------------- leftovers
def test_a_save_killed_midway_is_removed_and_said_at_the_next_start(tmp_path):
    """A kill during a save left .global_stepN.tmp-* until the next save."""
    config = tmp_path / "mlp.json"
    config.write_text(json.dumps(MLP_CONFIG))
    stale = tmp_path / "run" / "checkpoints" / ".global_step4.tmp-abc123"
    stale.mkdir(parents=True)
    (stale / "rank0.pt.part").write_bytes(b"half")
    proc = subprocess.run([sys.executable, "-m", "minizero", "train", "--config", str(config), "--model", "mlp",
                           "--steps", "1", "--no-progress", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"removed {stale}, left by a save that was interrupted") == 1, proc.stderr
    assert not stale.exists()


# ---------------------------------------------------------------------------- the grader's hint on a timeout
def test_a_timeout_with_every_rank_in_its_own_code_is_not_called_a_deadlock(tmp_path):
    """A lab file with an endless loop timed out with a hint blaming a collective deadlock. The words are the
    launcher's own (describe_ranks reads heartbeat files like those a job writes)."""
    from minizero import launch
    from minizero_course.grader.hints import likely_cause
    from minizero.comm.backends import describe_ranks
    (tmp_path / "rank0.op").write_text("idle (last: all_reduce)")  # rank 1 never reached a collective
    (tmp_path / "rank2.op").write_text("all_reduce (40 B) on world")
    looping = likely_cause(str(launch.LaunchTimeout(90, describe_ranks(str(tmp_path), 2))))
    waiting = likely_cause(str(launch.LaunchTimeout(90, describe_ranks(str(tmp_path), 3))))
    assert looping.startswith("no rank was waiting in a collective") and "endless loop" in looping, looping
    assert waiting.startswith("a deadlock"), waiting


def test_every_variable_is_documented():
    page = open(os.path.join(ROOT, "docs", "environment.md")).read()
    assert [name for name in env.VARIABLES if f"| `{name}` |" not in page] == []
