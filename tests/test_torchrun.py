"""`python -m minizero torchrun`: torchrun that says what a multi-node rendezvous waits for, fails it in one line
within the rendezvous timeout, reports a failed worker in one line with its exit code, and leaves no folder
(torchrun's own torchelastic_* log folder stayed in the temp directory after every run).

Real torchrun agents on this machine, each test under a timeout; skipped where torch has no torchrun.
"""
import os
import subprocess
import sys

import pytest

from tests.machine import free_port, guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                                 reason="torch's torchrun is not installed next to this Python"),
              pytest.mark.launches]  # starts ranks or processes: not in `make check`


def _env(tmp_path, **extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "MINIZERO_HEARTBEAT_DIR"):
        env.pop(v, None)
    return {**env, **extra}


def _agent(tmp_path, *args, **env):
    cmd = [sys.executable, "-m", "minizero", "torchrun", *args, "tests/fault_script.py"]
    return subprocess.Popen([*cmd, env.pop("mode", "ok")], cwd=ROOT, env=_env(tmp_path, **env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_nodes_with_one_agent_say_what_they_wait_for_and_end_in_one_line(backend, tmp_path):
    port = free_port()
    where = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"] if backend == "c10d"
             else ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)])
    proc = _agent(tmp_path, "--nnodes", "2", "--nproc_per_node", "1", *where, MINIZERO_INIT_TIMEOUT_S="4")
    text = proc.communicate(timeout=guard(150))[0]  # start-up, then the 4 s rendezvous timeout
    assert proc.returncode == 2, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].startswith("minizero torchrun: this agent waits up to 4 s ") and \
        f"for 2 agents (nodes) at 127.0.0.1:{port} ({backend} rendezvous)" in lines[0], text
    assert lines[-1].startswith(f"minizero torchrun: the rendezvous at 127.0.0.1:{port} did not complete"), text
    assert "Traceback" not in text and "never stopped" not in text, text  # no worker ran
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no torchelastic_*, no minizero-*


def test_two_agents_meet_and_run_the_script(tmp_path):
    port = free_port()
    wait = f"{guard(120):.0f}"
    agents = [_agent(tmp_path, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", MINIZERO_INIT_TIMEOUT_S=wait)
              for _ in range(2)]
    texts = [a.communicate(timeout=guard(240))[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], texts
    assert sorted(line for t in texts for line in t.splitlines() if "was never stopped" in line) == \
        ["fault_script: rank 0 was never stopped", "fault_script: rank 1 was never stopped"], texts
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_failed_worker_is_one_line_with_its_exit_code(tmp_path):
    """Every rank fails alike (exit 2): minizero's message once, then one line, not torchrun's ChildFailedError."""
    port = str(free_port())
    proc = _agent(tmp_path, "--nproc_per_node", "2", "--master-port", port, mode="fail_all")
    text = proc.communicate(timeout=guard(240))[0]
    assert proc.returncode == 2, text[-3000:]
    assert text.count("the input is bad") == 1 and "ChildFailedError" not in text and "Traceback" not in text, text
    assert "minizero torchrun: rank " in text and "exited with code 2" in text, text
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
