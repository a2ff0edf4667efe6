"""minizero's environment variables, read and checked in this one place.

Every MINIZERO_* variable a user may set is listed in VARIABLES with what it allows. `get(name)`
returns its value (the default when unset) or raises EnvError naming the variable, the value and
what is allowed; `check()` does that for every variable that is set. The commands (train, bench,
grade, demo) and comm.init call `check_or_exit` before anything starts, so a typo is one line and
exit code 2, said by launched rank 0 only, instead of a traceback from every rank at its first use.

The variables launch.run sets for its own jobs (MINIZERO_JOB_ID, MINIZERO_SCALE_PROBE) are markers,
not settings, and the test suite's (MINIZERO_SITE, MINIZERO_MUTANT_TABLE) are read by the tests:
neither is here.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable


class EnvError(ValueError):
    """A MINIZERO_* variable holds a value minizero cannot use; the message names it and what is
    allowed."""


@dataclass(frozen=True)
class Variable:
    parse: Callable[[str], Any]  # text -> value; raises ValueError when the text is not allowed
    default: Any                 # the value when the variable is unset
    allowed: str                 # what may be set, in words (the error says it)
    means: str                   # what it does (docs/environment.md lists these)


def _seconds(zero_ok: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)  # ValueError for 'abc'
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(text)
        return value
    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(text)
        return text
    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _scale(text: str):
    """A timeout factor: a number >= 1, or "load" (measured at each use: load_scale())."""
    if text == "load":
        return text
    value = float(text)
    if not math.isfinite(value) or value < 1:
        raise ValueError(text)
    return value


MAX_LOAD_SCALE = 20.0  # a real hang still ends: a 60 s timeout waits at most 20 minutes


def load_scale() -> float:
    """How many times slower than idle a job runs now: the 1-minute load average per core, in
    [1, 20]."""
    return min(MAX_LOAD_SCALE, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def _directory(text: str) -> str:
    if not os.path.isdir(text) or not os.access(text, os.W_OK | os.X_OK):
        raise ValueError(text)
    return text


VARIABLES: dict[str, Variable] = {
    "MINIZERO_BACKEND": Variable(
        _choice("mpi", "torch"), None,
        "mpi or torch (torch picks NCCL on CUDA and gloo on CPU by itself)",
        "the communicator's library; unset: mpi on CPU under mpirun, torch otherwise"),
    "MINIZERO_DEBUG": Variable(
        _flag, False, "0 or 1",
        "1: every collective first compares its shapes and dtypes across ranks (one small "
        "all-gather each)"),
    "MINIZERO_WATCHDOG_S": Variable(
        _seconds(zero_ok=True), 300.0, "seconds, a number >= 0 (0 turns the watchdog off)",
        "a rank blocked this long in one collective ends the job, naming every rank's place "
        "(default 300)"),
    "MINIZERO_INIT_TIMEOUT_S": Variable(
        _seconds(zero_ok=False), 60.0, "seconds, a number > 0",
        "how long the torch.distributed rendezvous waits for every rank, and `minizero torchrun`'s "
        "for every agent (default 60)"),
    "MINIZERO_HEARTBEAT_DIR": Variable(
        _directory, None, "an existing directory this process can write to",
        "where the ranks' heartbeat files go (launch.run sets it; across machines: a shared "
        "directory)"),
    "MINIZERO_MAX_RANKS": Variable(
        _positive_int, 8, "a whole number >= 1",
        "the most ranks launch.run starts on this machine (default 8: 2 cores oversubscribed "
        "further are flaky)"),
    "MINIZERO_ZYGOTE": Variable(
        _flag, None, "0 or 1",
        "1: launch.run forks its ranks from one process that imported torch once "
        "(minizero/zygote.py) instead of every rank importing it, seconds less per launch; 0: "
        "every rank starts cold. Unset: 1 on a machine without an NVIDIA GPU, 0 with one"),
    "MINIZERO_MPI_STAGE": Variable(
        _flag, False, "0 or 1",
        "1: the mpi backend stages CPU tensors through a host copy too, as it always does CUDA "
        "ones (several ranks on one GPU); make test-gpu's --quick run takes that path on CPU"),
    "MINIZERO_STRICT_HOST": Variable(
        _flag, False, "0 or 1",
        "1: the offload tiers mark their host tensors and every collective refuses one, as NCCL "
        "refuses a CPU tensor (minizero/host.py): the test suite's way to find that bug on a "
        "machine without a GPU"),
    "MINIZERO_GRADESCOPE_ROOT": Variable(
        _directory, "/autograder", "an existing directory this process can write to",
        "the Gradescope autograder's folder (source/, submission/, results/); tests simulate it in "
        "a temporary one"),
    "MINIZERO_GRADESCOPE_LIMIT_S": Variable(
        _seconds(zero_ok=False), 540.0, "seconds, a number > 0",
        "the Gradescope autograder stops grading after this long and writes results.json (default "
        "540)"),
    "MINIZERO_TIMEOUT_SCALE": Variable(
        _scale, 1.0, "a number >= 1, or load",
        "every launch.run job's timeout (lessons, lab checks) is multiplied by it; load: by the "
        "1-minute load average per core at each launch, 1 to 20 (a shared machine; the test suite "
        "sets load)"),
    "MINIZERO_MULTINODE": Variable(
        _flag, False, "0 or 1",
        "1: under mpirun, rank 0 announces its hostname's address for torch.distributed, not "
        "127.0.0.1"),
}


def _bool_word(text: str) -> bool:
    """Accelerate's str_to_bool: true/false, yes/no, 1/0, on/off (any case)."""
    low = text.lower()
    if low in ("1", "true", "yes", "y", "on", "t"):
        return True
    if low in ("0", "false", "no", "n", "off", "f"):
        return False
    raise ValueError(text)


def _clip_value(text: str):
    """gradient clipping: "auto" (DeepSpeed's 1.0, as Accelerate fills it) or a number >= 0."""
    return "auto" if text == "auto" else _seconds(zero_ok=True)(text)


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ValueError(text)
    return int(text)


def _fsdp_strategy(text: str) -> str:
    """FSDP_SHARDING_STRATEGY: a name, or Accelerate's older numbers 1..3 in torch's
    ShardingStrategy order (HYBRID_SHARD, 4, is not covered: minizero's hybrid sharding is the
    engine's zero_hpz_partition_size)."""
    names = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    if text.upper() not in names:
        raise ValueError(text)
    return text.upper()


# What `accelerate launch` sets for its ranks (accelerate/utils/launch.py) and minizero.accelerate
# reads: the Accelerator is configured by them, as Accelerate's
# is. Their names are Accelerate's, not minizero's.
ACCELERATE_VARIABLES: dict[str, Variable] = {
    "ACCELERATE_CONFIG_FILE": Variable(str, None, "a path to an Accelerate config YAML",
                                       "the config minizero.accelerate reads when no launcher set "
                                       "ACCELERATE_*"),
    "ACCELERATE_USE_CPU": Variable(_bool_word, False, "true or false",
                                   "train on the CPU even with a GPU"),
    "ACCELERATE_USE_DEEPSPEED": Variable(_bool_word, False, "true or false",
                                         "distributed_type DEEPSPEED"),
    "ACCELERATE_USE_FSDP": Variable(_bool_word, False, "true or false", "distributed_type FSDP"),
    "ACCELERATE_MIXED_PRECISION": Variable(_choice("no", "fp16", "bf16"), "no", "no, fp16 or bf16",
                                           "mixed_precision (fp8 is not covered by minizero)"),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": Variable(_positive_int, None, "a whole number >= 1",
                                                       "gradient_accumulation_steps"),
    "ACCELERATE_GRADIENT_CLIPPING": Variable(_clip_value, "auto", "auto or a number >= 0",
                                             "DeepSpeed's gradient_clipping (auto: 1.0, as "
                                             "Accelerate fills it)"),
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": Variable(_stage, 2, "0, 1, 2 or 3",
                                                "DeepSpeed's zero_optimization.stage"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": Variable(_choice("none", "cpu", "nvme"),
                                                              "none", "none, cpu or nvme",
                                                              "offload_optimizer.device"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": Variable(_choice("none", "cpu", "nvme"), "none",
                                                          "none, cpu or nvme",
                                                          "offload_param.device"),
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": Variable(_bool_word, None, "true or false",
                                                "build the model under zero.Init (stage 3)"),
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": Variable(str, None, "a path to a DeepSpeed JSON config",
                                                 "deepspeed_config_file: its \"auto\" values are "
                                                 "filled"),
    "FSDP_SHARDING_STRATEGY": Variable(_fsdp_strategy, "FULL_SHARD",
                                       "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or 1..3 (HYBRID_SHARD "
                                       "is not covered)",
                                       "FSDP's sharding: ZeRO-3, ZeRO-2 or DDP here"),
    "FSDP_OFFLOAD_PARAMS": Variable(_bool_word, False, "true or false",
                                    "FSDP's CPU offload of parameters"),
}


def accelerate_get(name: str, environ=None):
    """An Accelerate variable's value (its default when unset); EnvError naming it and what is
    allowed."""
    return _read(ACCELERATE_VARIABLES, name, environ, "")

def get(name: str, environ=None):
    """The variable's value (its default when unset); EnvError when it is set to something not
    allowed. environ: the environment to read (default os.environ; launch.run checks its ranks'
    before starting them)."""
    return _read(VARIABLES, name, environ, " (or unset it)")


def _read(table: dict, name: str, environ, unset: str):
    var = table[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise EnvError(f"environment variable {name}={text!r} is not allowed: use "
                       f"{var.allowed}{unset}. {name}: {var.means}") from None


def is_set(name: str) -> bool:
    """Whether the variable is in the environment at all (MINIZERO_HEARTBEAT_DIR set: launch.run's
    job)."""
    assert name in VARIABLES, name
    return name in os.environ


def check(environ=None) -> dict:
    """Every set variable's value; EnvError for the first one that is not allowed."""
    environ = os.environ if environ is None else environ
    return {name: get(name, environ) for name in VARIABLES if name in environ}


def launched_rank() -> int:
    """This process's rank as the launcher announced it (PMI_RANK, OMPI_COMM_WORLD_RANK, RANK), read
    WITHOUT creating a communicator: lets rank 0 alone report an input error every rank finds.
    comm.launcher (which reads the launcher's other variables) gives it as comm.launched_rank()."""
    for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if v in os.environ:
            return int(os.environ[v])
    return 0


def check_or_exit(prog: str = "minizero"):
    """check(), and on a bad variable: launched rank 0 prints the one line, every rank exits with
    code 2 (before any rank has met another: nothing to end, nothing written)."""
    try:
        check()
    except EnvError as e:
        if launched_rank() == 0:
            sys.stderr.write(f"{prog}: {e}\n")
            sys.stderr.flush()
        raise SystemExit(2) from None
