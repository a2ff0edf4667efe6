"""Rendezvous ports on a shared machine: minizero's launchers (python -m minizero.launcher,
python -m minizero.accelerate.launch) take a free port when none is given, as
`torchrun --standalone` does, and say which; a job holding 29500, everyone's default, does not stop
them; the tests' own helper (tests/machine.py) hands out free, distinct ports.
"""
import os
import re
import socket
import subprocess
import sys

import pytest

from minizero.accelerate import launch as acc_launch
from minizero.launcher import runner
from tests import machine

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "tests/torchrun_script.py"  # 2 ranks, 3 DDP steps, one RESULT line per rank
# accelerate.launch under torchrun, as where no mpirun is installed (under mpirun, MPI picks its
# own port)
NO_MPIRUN = ("import sys\nfrom minizero import launch\n"
             "from minizero.accelerate import launch as a\n"
             "def find_mpirun(): raise launch.LaunchError('no mpirun here')\n"
             "launch.find_mpirun = find_mpirun; sys.exit(a.main(sys.argv[1:]))")
CHOSEN = re.compile(r"rendezvous port (\d+) \(free, chosen here; "
                    r"--(master|main_process)_port sets one\)")
TAKEN = "RuntimeError: ... port: {}, useIpv6: false, code: -98, name: EADDRINUSE, message: ..."


def test_free_ports_are_free_distinct_and_never_the_default():
    ports = [machine.free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and machine.DEFAULT_PORT not in ports
    for port in ports[:3]:  # nothing listens there: a server can bind it
        with socket.socket() as s:
            s.bind(("", port))


class _Done:
    def __init__(self, stderr):
        self.stdout, self.stderr = "", stderr


def test_a_port_collision_is_retried_on_a_new_port_and_only_then():
    tried = []
    result = machine.retry_on_port_collision(lambda port: tried.append(port) or _Done(
        TAKEN.format(port) if len(tried) < 3 else "ok"))
    assert result.stderr == "ok" and len(set(tried)) == 3
    tried.clear()
    result = machine.retry_on_port_collision(lambda port: tried.append(port) or _Done("boom"))
    assert result.stderr == "boom" and len(tried) == 1  # another failure is the test's to report


@pytest.mark.parametrize("argv,says", [
    (["--master_port", "0", SCRIPT], "--master_port 0: give a port number 1..65535"),
    (["--master_port", "70000", SCRIPT], "--master_port 70000: give a port number 1..65535"),
])
def test_a_bad_master_port_is_one_message_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_bad_main_process_port_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE", raising=False)
    monkeypatch.setattr(acc_launch.acc_config, "default_config_file", lambda: "/no/such/c.yaml")
    code = acc_launch.main(["--num_processes", "2", "--main_process_port", "65536", SCRIPT])
    err = capsys.readouterr().err
    prog = acc_launch.parser().prog
    assert code == 2 and err == f"{prog}: --main_process_port 65536: give a port number 1..65535\n"


def _env():
    dropped = ("ACCELERATE_", "PMI_", "OMPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_the_launchers_run_beside_a_job_holding_port_29500():
    """What a busy machine looks like to a launch: another job's store listening on 29500
    (connections to it are accepted and never answered). minizero.launcher under mpirun and under
    torchrun, and accelerate.launch under torchrun, each at 2 ranks, still train, on a port they
    chose and named."""
    launcher = [sys.executable, "-m", "minizero.launcher", "--num_gpus", "2"]
    launches = {
        "minizero.launcher, mpirun": [*launcher, SCRIPT],
        "minizero.launcher, torchrun": [*launcher, "--launcher", "torchrun", SCRIPT],
        "accelerate.launch, torchrun": [sys.executable, "-c", NO_MPIRUN, "--num_processes", "2",
                                        "--cpu", SCRIPT],
    }
    with machine.holding_port(machine.DEFAULT_PORT) as held:
        if held is None:
            pytest.skip(f"port {machine.DEFAULT_PORT} is held by another job on this machine: the "
                        "launches would run beside it, but this test could not make sure of it")
        done = {name: subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(),
                                     timeout=machine.guard(240))
                for name, cmd in launches.items()}
        assert held.getsockname()[1] == machine.DEFAULT_PORT  # held all along
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stdout[-2000:] + proc.stderr[-3000:])
        said = CHOSEN.findall(proc.stderr)
        assert len(said) == 1 and int(said[0][0]) != machine.DEFAULT_PORT, (name, proc.stderr)
        ranks = proc.stdout.split("RESULT ")[1:]
        assert len(ranks) == 2 and all('"size": 2' in r for r in ranks), (name, proc.stdout)
