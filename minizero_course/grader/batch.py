"""Grade many submissions at once, sharing launches: the fast path of the mutation suite.

A check launches its ranks with `launch.run(worker, nprocs, args={"impl": file, ...})`, and a
launch costs seconds of start-up (mpirun, Python, torch) before the worker does anything.
Grading M files on C checks one launch at a time pays that M x C times. `run_checks` pays it
about once per rank count: it runs every check with `launch.run` replaced by a recorder, so
that a check's first launch is queued instead of run (the check is stopped with `Deferred`);
it then starts ONE job per (ranks, backend, env) that calls each queued (worker, file) in turn,
whichever check and lab it belongs to, and re-runs the checks, which now get their results as
if they had launched alone. A check that launches twice takes two rounds. The verdicts are the
checks' own: nothing about grading changes.

Inside the shared job each call gets a communicator of its own (`comm.split`), so a message
a buggy call leaves behind cannot reach the next call, and the transient-memory tracker and
torch's global settings (default dtype, seed) are reset between calls. A call that raises or
crashes ends the job (the launcher aborts it, as for a single launch): its ranks may be
stuck in different collectives. Its error is that call's result, the calls before it keep
theirs (each writes its result, then the ranks pass a barrier before the next one starts),
and the calls after it go on in a new job.

Each call keeps its own deadline inside the job: its launch's timeout times
MINIZERO_TIMEOUT_SCALE (the load per core when it is `load`, read again while the call runs), as
generous as the call's own launch would have been (that one paid start-up inside its timeout too).
A rank-0 thread watches the time; a call past its deadline is hung (a deadlock, an endless loop):
the thread writes where every rank was (the heartbeats launch.run reads on a timeout) and aborts
the job, the call gets the LaunchTimeout its own launch would have raised, and the calls after it
go on in a new job. So a deadlock costs one call's deadline, not the sum of the job's. The job's
own timeout, the sum, stays as a backstop: a job that reaches it (no deadline fired: slow, not
hung) is blamed on no call, each unfinished call runs alone with its own timeout.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from contextlib import contextmanager

from minizero import launch


class Deferred(BaseException):
    """Stops a check at a launch that is queued, not run (a BaseException, so that the checks'
    own `except Exception` that keep a failed launch for later do not keep this one)."""


def _deadline_watch(comm, calls, out, now: dict):
    """Rank 0's thread: the call running past its deadline is reported in {i}.hung.json, and the job
    aborted (the other calls go on in a new job)."""
    from minizero import env as mz_env
    from minizero.comm.backends import describe_ranks
    start_scale = launch.timeout_scale()
    while True:
        time.sleep(0.2)
        i, t0 = now["call"]
        if i >= len(calls):
            return
        # the scale read again: a load that rose during the call is the machine's, not the call's
        limit = calls[i][2] * max(start_scale, launch.timeout_scale())
        if time.monotonic() - t0 <= limit:
            continue
        where = describe_ranks(mz_env.get("MINIZERO_HEARTBEAT_DIR"), comm.size)
        for r in range(comm.size):
            if os.path.exists(os.path.join(out, f"{i}.{r}.json")):  # its part done, in the barrier
                where[r] = "had returned from this call and waited for the others"
        path = os.path.join(out, f"{i}.hung.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"timeout": round(limit, 1), "where": where}, f)
        os.replace(path + ".tmp", path)
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)  # every rank of the job ends now, wherever it is blocked


def worker(comm, calls, out):
    """Runs on every rank of a shared job: each call's (target, args, timeout), in turn."""
    import torch

    from minizero import memory
    fns: dict = {}
    dtype, rng = torch.get_default_dtype(), torch.get_rng_state()
    now = {"call": (0, time.monotonic())}
    if comm.rank == 0:
        threading.Thread(target=_deadline_watch, args=(comm, calls, out, now), daemon=True).start()
    for i, (target, args, _) in enumerate(calls):
        if target not in fns:
            fns[target] = launch.load_target(target)
        now["call"] = (i, time.monotonic())
        memory.transient.reset()
        torch.set_default_dtype(dtype)  # as a fresh process has them: what a call sets, it sets for itself
        torch.set_rng_state(rng)
        own = comm.split(0, name=comm.name)  # a communicator per call: no message crosses calls
        result = fns[target](own, **args)
        path = os.path.join(out, f"{i}.{comm.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
        comm.barrier()  # call i is complete on every rank before call i + 1 starts anywhere
    now["call"] = (len(calls), time.monotonic())
    return len(calls)


def _key(target, nprocs, args, backend, env):
    return json.dumps([target, nprocs, args, backend, env], sort_keys=True)


def _launch_shared(nprocs, backend, env, calls: list[tuple[str, str, dict, float]], results: dict):
    """Run every (key, target, args, timeout) of `calls` in as few jobs as possible; fill results[key]."""
    todo = list(calls)
    while todo:
        with tempfile.TemporaryDirectory(prefix="minizero-batch-") as out:
            try:
                launch.run(f"{__name__}:worker", nprocs=nprocs, backend=backend, env=env,
                           args={"calls": [[target, args, t] for _, target, args, t in todo],
                                 "out": out},
                           # each call's deadline starts after the job's start-up: one more of
                           # them as headroom, so a hung call meets its deadline, not this backstop
                           timeout=sum(t for *_, t in todo) + max(t for *_, t in todo))
                error = None
            except launch.LaunchError as e:
                error = e
            done = 0
            for key, *_ in todo:
                files = [os.path.join(out, f"{done}.{r}.json") for r in range(nprocs)]
                if not all(os.path.exists(p) for p in files):
                    break
                results[key] = [json.load(open(p)) for p in files]
                done += 1
            hung = os.path.join(out, f"{done}.hung.json")
            if error is not None and os.path.exists(hung):  # past its own deadline: this call hung
                with open(hung) as f:
                    report = json.load(f)
                where = {int(r): w for r, w in report["where"].items()}
                error = launch.LaunchTimeout(report["timeout"], where, error.output)
                results[todo[done][0]] = error
                todo = todo[done + 1:]
                continue
        if error is None and done < len(todo):
            error = launch.LaunchError(f"the shared job ended after {done} of {len(todo)} calls")
        if error is None:
            return
        if isinstance(error, launch.LaunchTimeout):  # slow or hung: no call is to blame, each runs alone
            for key, target, args, timeout in todo[done:]:
                try:
                    results[key] = launch.run(target, nprocs=nprocs, args=args, timeout=timeout, backend=backend,
                                              env=env)
                except launch.LaunchError as e:
                    results[key] = e
            return
        results[todo[done][0]] = error  # the job ended in this call: its raise, crash or abort
        todo = todo[done + 1:]


@contextmanager
def _recording(results: dict, queue: dict):
    """launch.run answers from `results`, or queues the launch and raises Deferred."""
    real = launch.run

    def run(target, nprocs=2, args=None, timeout=120, backend=None, env=None, stream=False):
        key = _key(target, nprocs, args or {}, backend, env or {})
        if key in results:
            if isinstance(results[key], BaseException):
                raise results[key]
            return results[key]
        queue.setdefault((nprocs, backend, json.dumps(env or {}, sort_keys=True)), {})[key] = (target, args or {},
                                                                                                timeout)
        raise Deferred(key)

    launch.run = run
    try:
        yield
    finally:
        launch.run = real


def run_checks(jobs: list[tuple], progress=None) -> list[dict]:
    """`jobs`: (lab, check, impl) triples. Returns each one's Gradescope entry, exactly as
    `grader.run_check(lab, check, impl)` would, with the launches of all of them shared."""
    from minizero_course.grader import run_check
    entries: list = [None] * len(jobs)
    results: dict = {}
    pending = list(range(len(jobs)))
    while pending:
        queue: dict = {}
        waiting = []
        with _recording(results, queue):
            for i in pending:
                try:
                    entries[i] = run_check(*jobs[i])
                except Deferred:
                    waiting.append(i)
        for (nprocs, backend, env), calls in queue.items():
            if progress:
                progress(f"{len(calls)} launches of {len({t for t, *_ in calls.values()})} workers on {nprocs} ranks "
                         "in one job")
            _launch_shared(nprocs, backend, json.loads(env) or None,
                           [(key, *call) for key, call in calls.items()], results)
        if waiting and not queue:
            raise RuntimeError("checks were deferred but queued no launch")  # cannot happen; never loop forever
        pending = waiting
    return entries
