"""Functions the comm/launch tests run on N ranks through minizero.launch (never in pytest itself)."""
import os
import time

import numpy as np
import torch

from minizero.comm import ring_bytes_sent


def _rank_data(rank, n, dtype=torch.float32):
    # integer-valued floats: sums are exact in any order, so both backends must agree bitwise
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def every_collective(comm, sizes=(1, 7, 10, 4099)):
    """Each collective against a numpy reference built from every rank's (reproducible) data."""
    N, r = comm.size, comm.rank
    bad, expected_sent = [], 0.0
    def allv(n, dt=torch.float32):
        return [_rank_data(q, n, dt).double().numpy() for q in range(N)]
    for n in sizes:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            esz = torch.tensor([], dtype=dtype).element_size()
            ref = allv(n, dtype)
            # all_reduce sum / max / avg
            for op, f in (("sum", np.sum), ("max", np.max), ("avg", np.mean)):
                t = _rank_data(r, n, dtype)
                comm.all_reduce(t, op=op)
                want = f(np.stack(ref), axis=0)
                if not np.allclose(t.double().numpy(), want,
                                   rtol={torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 1e-12)):
                    bad.append(f"all_reduce {op} n={n} {dtype}")
                expected_sent += ring_bytes_sent("all_reduce", n * esz, N)
            # reduce_scatter: input padded to a multiple of N (the caller's job; ZeRO pads too)
            k = -(-n // N)
            inp = torch.zeros(k * N, dtype=dtype)
            inp[:n] = _rank_data(r, n, dtype)
            out = torch.empty(k, dtype=dtype)
            comm.reduce_scatter(out, inp)
            full = np.zeros(k * N)
            full[:n] = np.sum(np.stack(ref), axis=0)
            if not np.allclose(out.double().numpy(), full[r * k:(r + 1) * k],
                               rtol=1e-2 if dtype == torch.bfloat16 else 0):
                bad.append(f"reduce_scatter n={n} {dtype}")
            expected_sent += ring_bytes_sent("reduce_scatter", k * N * esz, N)
            # all_gather
            mine = _rank_data(r, n, dtype)
            g = torch.empty(n * N, dtype=dtype)
            comm.all_gather(g, mine)
            if not np.array_equal(g.double().numpy(), np.concatenate(ref)):
                bad.append(f"all_gather n={n} {dtype}")
            expected_sent += ring_bytes_sent("all_gather", n * N * esz, N)
            # broadcast from the last rank
            t = _rank_data(r, n, dtype)
            comm.broadcast(t, src=N - 1)
            if not np.array_equal(t.double().numpy(), ref[N - 1]):
                bad.append(f"broadcast n={n} {dtype}")
            expected_sent += ring_bytes_sent("broadcast", n * esz, N)
            # reduce to rank 0
            t = _rank_data(r, n, dtype)
            comm.reduce(t, dst=0)
            if r == 0 and not np.allclose(t.double().numpy(), np.sum(np.stack(ref), axis=0),
                                          rtol=1e-2 if dtype == torch.bfloat16 else 0):
                bad.append(f"reduce n={n} {dtype}")
            expected_sent += ring_bytes_sent("reduce", n * esz, N)
        # all_to_all: chunk j of rank i goes to rank j
        inp = torch.arange(N * n, dtype=torch.float32) + 1000 * r
        out = torch.empty_like(inp)
        comm.all_to_all(out, inp)
        want = np.concatenate([np.arange(r * n, (r + 1) * n) + 1000 * q for q in range(N)])
        if not np.array_equal(out.numpy(), want):
            bad.append(f"all_to_all n={n}")
        expected_sent += ring_bytes_sent("all_to_all", N * n * 4, N)
    # p2p ring: send to the right, receive from the left
    t = torch.full((5,), float(r))
    got = torch.empty(5)
    if N > 1:
        s = comm.isend(t, (r + 1) % N)
        comm.recv(got, (r - 1) % N)
        s.wait()
        if not torch.equal(got, torch.full((5,), float((r - 1) % N))):
            bad.append("send/recv")
        expected_sent += 20
    # async all_reduce overlapping with "compute"
    t = torch.ones(1000) * (r + 1)
    h = comm.all_reduce(t, async_op=True)
    _ = torch.randn(64, 64) @ torch.randn(64, 64)
    h.wait()
    if not torch.all(t == N * (N + 1) / 2):
        bad.append("async all_reduce")
    expected_sent += ring_bytes_sent("all_reduce", 4000, N)
    comm.barrier()
    return {"bad": bad, "stats": comm.stats.as_dict(), "sent": comm.stats.sent(),
            "expected_sent": expected_sent, "backend": comm.backend}


def every_collective_staged(comm):
    """every_collective through an MPIBackend that stages every tensor through a host copy (the path CUDA
    tensors take when several ranks share one GPU): a missing copy back leaves outputs unwritten."""
    from mpi4py import MPI

    from minizero.comm.backends import MPIBackend
    from minizero.comm.communicator import Communicator
    staged = Communicator("mpi", MPIBackend(MPI.COMM_WORLD.Dup(), stage_all=True), comm.device, name="staged")
    return every_collective(staged)


def subgroups(comm):
    """split into even/odd ranks and new_group of the first two; stats roll up to the world."""
    sub = comm.split(comm.rank % 2)
    t = torch.tensor([float(comm.rank)])
    sub.all_reduce(t)
    pair = comm.new_group([0, 1]) if comm.size >= 2 else None
    p = torch.tensor([1.0])
    if pair is not None:
        pair.all_reduce(p)
    return {"sub_rank": sub.rank, "sub_size": sub.size, "sum": t.item(), "pair": p.item(),
            "world_sent": comm.stats.sent(), "sub_sent": sub.stats.sent()}


def sleeping_barrier(comm, late_s=0.3):
    """Rank 0 arrives late at barrier(sleep_s=...), on the world and on a split: the others wait for
    it asleep (little CPU) and the barriers are counted as calls of 0 bytes."""
    comm.stats.reset()
    sub = comm.split(comm.rank % 2)
    if comm.rank == 0:
        time.sleep(late_s)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    comm.barrier(sleep_s=0.001)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    sub.barrier(sleep_s=0.001)
    return {"cpu": cpu, "wall": wall, "barrier": comm.stats.as_dict()["barrier"], "sent": comm.stats.sent()}


def shape_mismatch_local(comm):
    comm.reduce_scatter(torch.empty(3), torch.empty(7))


def shape_mismatch_across_ranks(comm):
    comm.debug = True
    comm.all_reduce(torch.zeros(10 + comm.rank))


def raise_on_rank(comm, rank=1):
    if comm.rank == rank:
        raise KeyError("deliberate failure")
    comm.barrier()
    return comm.rank


def hang_in_collective(comm):
    """Rank 0 never joins the all_gather the others wait in."""
    if comm.rank == 0:
        time.sleep(600)
    out = torch.empty(4 * comm.size)
    comm.all_gather(out, torch.zeros(4))


def report_pid(comm):
    return os.getpid()


def report_parent(comm):
    return os.getppid()


def needs_four(comm):
    comm.require_size(4, "lab 6 layout")


def die_mid_step(comm, rank=1):
    """A rank killed by the OS (OOM killer, node failure) in the middle of a step."""
    import signal
    t = torch.ones(1000)
    comm.all_reduce(t)
    if comm.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(t)
    comm.all_reduce(t)
    return 1


def differing_params_under_zero(comm, which):
    """Each rank builds its model with a different seed: debug=True must refuse it."""
    from minizero.models import build_model
    from minizero.zero.sharded_optimizer import ShardedOptimizer
    from minizero.zero.shard_grad_op import ShardGradOp
    from minizero.zero.fsdp import FSDP
    model = build_model("mlp", seed=comm.rank)
    if which == "zero1":
        ShardedOptimizer(model.parameters(), torch.optim.SGD, comm=comm, debug=True, lr=0.1)
    elif which == "zero2":
        ShardGradOp(model, torch.optim.SGD, comm=comm, debug=True, lr=0.1)
    else:
        FSDP(model, comm=comm, debug=True)


def mesh_groups(comm, layouts):
    """For each (dp, pp, tp, node_size): the world ranks each of this rank's groups really holds
    (an all-gather of world ranks over the group), its pipeline neighbours, and the bytes a
    sub-group all-reduce adds to the sub-group's and the world's stats."""
    from minizero.comm import Mesh
    out = []
    for dp, pp, tp, node_size in layouts:
        mesh = Mesh(comm, dp=dp, pp=pp, tp=tp, node_size=node_size)
        members = {}
        for axis in ("dp", "pp", "tp", "node", "cross_node"):
            group = getattr(mesh, axis)
            got = torch.zeros(group.size, dtype=torch.int64)
            group.all_gather(got, torch.tensor([comm.rank], dtype=torch.int64))
            members[axis] = got.tolist()
        comm.stats.reset()
        mesh.dp.stats.reset()
        payload = torch.ones(1000, dtype=torch.float32)
        mesh.dp.all_reduce(payload)
        out.append({"coords": [mesh.dp_rank, mesh.pp_rank, mesh.tp_rank], "members": members,
                    "pp_prev": mesh.pp_prev, "pp_next": mesh.pp_next,
                    "first": mesh.is_first_stage, "last": mesh.is_last_stage,
                    "groups": {a: mesh.groups(a) for a in members},
                    "sum": payload[0].item(), "dp_sent": mesh.dp.stats.sent(), "world_sent": comm.stats.sent(),
                    "world_cross": comm.stats.cross_node()})
    return out
