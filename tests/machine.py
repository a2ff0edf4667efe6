"""What a test needs of a shared machine: a rendezvous port nobody else uses, time limits that are
deadlock guards scaled to how busy the machine is now, and a CPU load to run tests beside
(tests/test_busy_machine.py).

A laptop running the suite also runs other jobs: other test runs launching torchrun and DeepSpeed on
their default port 29500, compilers, browsers. A fixed port lets two jobs meet at one store and mix
their ranks; a fixed time limit turns a slow machine into a failure. Neither is what a test checks.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

# torchrun's, DeepSpeed's and Accelerate's default rendezvous port: every other job's here too
DEFAULT_PORT = 29500
# what torch's TCPStore, gloo and MPICH print when the port they were given is taken
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")
MAX_SLOWDOWN = 20.0  # a real deadlock still ends: a 60 s guard waits at most 20 minutes
_given: set[int] = set()


def free_port() -> int:
    """A TCP port free on every interface now, asked of the OS; never DEFAULT_PORT, never one this
    process handed out before (two tests of one session then cannot collide with each other)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port != DEFAULT_PORT and port not in _given:
            _given.add(port)
            return port
    raise RuntimeError("the OS handed out 100 ports this process had used already")


def port_taken(text: str) -> bool:
    return any(m in text for m in PORT_TAKEN)


def retry_on_port_collision(start, attempts: int = 3):
    """start(port) -> a finished subprocess.CompletedProcess (anything with stdout and stderr); run
    again on a new free port when its output says the port was taken meanwhile (another job bound it
    between our asking and the rendezvous binding it), at most `attempts` times. Returns the
    last."""
    for _ in range(attempts):
        result = start(free_port())
        if not port_taken(f"{result.stdout or ''}{result.stderr or ''}"):
            return result
    return result


def slowdown() -> float:
    """How many times slower than an idle machine a job runs here now, >= 1: the larger of the
    run-queue length per core (the 1-minute load average) and the wall/CPU ratio of a 50 ms busy
    loop (the share of a core this process gets now; the load average lags a minute). Capped at
    MAX_SLOWDOWN."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while time.process_time() - cpu0 < 0.05:
        pass
    measured = (time.perf_counter() - wall0) / max(time.process_time() - cpu0, 1e-3)
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(MAX_SLOWDOWN, max(1.0, measured, load))


def guard(seconds: float) -> float:
    """A deadlock guard: `seconds` on an idle machine, scaled by slowdown() on a busy one. What a
    test checks is that a job ends, and says why, not how fast."""
    return seconds * slowdown()


def dump_stacks_after(config, seconds: float) -> None:
    """(Re-)arm pytest's faulthandler_timeout for the running test: every thread's stack dumped to
    pytest's own stderr after `seconds` unless the test ends first."""
    import faulthandler

    from _pytest.faulthandler import fault_handler_stderr_fd_key
    faulthandler.dump_traceback_later(seconds, file=config.stash.get(fault_handler_stderr_fd_key,
                                                                     sys.__stderr__))


@contextlib.contextmanager
def busy_cpu(seconds: float, per_core: int = 2):
    """per_core busy processes per core for at most `seconds`: each stops itself then, and all are
    killed when the block ends (a test that fails early leaves no load behind)."""
    code = (f"import time\nend = time.monotonic() + {seconds}\n"
            "while time.monotonic() < end:\n    pass\n")
    count = per_core * (os.cpu_count() or 1)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def holding_port(port: int):
    """Bind and listen on `port` (on every interface) for the block, as another job's store would;
    None when it is taken already (another job holds it: the point is made either way)."""
    s = socket.socket()
    try:
        s.bind(("", port))
        s.listen()
    except OSError:
        s.close()
        yield None
        return
    try:
        yield s
    finally:
        s.close()
