"""ZeRO-Infinity's disk tier: the fp32 masters and the optimizer state in files, stepped in
sub-groups.

Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
Learning" (SC'21), Sec. 5-6: model states go to NVMe, and the CPU step streams them through
host memory a piece at a time, with the next piece read while the current one steps
(DeepSpeed's `sub_group_size` is that piece, in elements). Per step and rank, with the rank's
S = Ψ/N elements and K = the optimizer's elementwise state (Adam: m and v, so 1 + K = 3 fp32
tensors with the master):

    disk read  = disk written = (1 + K)·4·S bytes       host RAM ~ (1 + K)·4·sub_group_numel x 3

(the current sub-group, the one prefetched, the one being written back). The gradients arrive on
the host as in ZeRO-Offload (zero/offload.py, whose counting and hooks this reuses) and the
updated parameters go back to the device a sub-group at a time.

With `param_nvme_path` (DeepSpeed's `offload_param.device: nvme`, stage 3) the parameter shards live
in files too: each shard's storage is a file mapped into memory, the updated values are written into
it (disk_written), and FSDP reads a shard out of it for each all-gather (the engine's fetch_shard,
disk_read). Per step and rank that adds 4·S written and 4·S per all-gather of a unit read.

`DiskOptimizer` keeps each sub-group in files `DIR/minizero-rank{r}-*/sg{i}.{master,exp_avg,...}`
(raw fp32, numpy's tofile/fromfile, which release the GIL), read and written by a thread pool:
reading i+1 while i steps (prefetch=True), writing i back while i+1 steps.
`traffic.disk_read/disk_written` count the bytes of every file read and written. The torch optimizer
is the same fused CPU one; each sub-group's master and state are swapped into it for its step.

Errors: an unusable `nvme_path` (missing and not creatable, not writable) fails at construction;
a failed write (disk full) fails the step with the path, and no checkpoint is touched.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from minizero import host, memory
from minizero.comm.labels import labelled
from minizero.zero.offload import OffloadedOptimizer, Traffic, cpu_optimizer, host_empty


class DiskError(OSError):
    pass


def check_nvme_path(path) -> str:
    """The directory, created if needed, proven writable; else a DiskError saying what to do."""
    if not path:
        raise DiskError("nvme_path is not set: give a directory for the offloaded state")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".minizero-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        raise DiskError(f"nvme_path {path!r} is not a writable directory ({e.strerror or e}); "
                        "point it at a directory you can write to") from None
    return os.path.abspath(path)


_write_hook = None  # tests: a function(path) called before each file write (simulates a full disk)
_LIBC = ctypes.CDLL(None, use_errno=True)
# Linux: drop the pages from this process; a shared file mapping reads them back on access
MADV_DONTNEED = 4


def release_pages(t: torch.Tensor):
    """Drop a file-mapped tensor's pages from this process (madvise MADV_DONTNEED). The values stay
    in the file (and the kernel's page cache, which is the disk's, not the process's); the next
    access reads them back in. RSS stops counting them. Only for storages made by torch.from_file
    (page-aligned)."""
    storage = t.untyped_storage()
    if _LIBC.madvise(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()),
                     MADV_DONTNEED):
        raise OSError(ctypes.get_errno(),
                      "madvise(MADV_DONTNEED) failed on a mapped parameter file")


class DiskOptimizer(OffloadedOptimizer):
    """A HostOptimizer whose masters and optimizer state live in files, stepped sub-group by
    sub-group (its interface, not its host copies: it derives from what the tiers share,
    offload.OffloadedOptimizer)."""

    def __init__(self, *args, **kwargs):
        # weakref.finalize per directory made: a constructor that fails removes them now
        self._removers = []
        try:
            self._build(*args, **kwargs)
        except BaseException:
            for remove in self._removers:  # (a rank that then ends with os._exit runs no finalizer)
                remove()
            raise

    def _build(self, device_params, optimizer_cls, nvme_path, sub_group_numel: int, rank: int = 0,
               traffic: Traffic | None = None, prefetch: bool = True, pin_memory: bool = False,
               after_params=None, io_threads: int = 1, param_nvme_path=None, **optimizer_kwargs):
        if sub_group_numel <= 0:
            raise ValueError(f"sub_group_numel must be > 0, got {sub_group_numel}")
        # no DPU on the disk tier
        super().__init__(device_params, traffic, pin_memory, None, after_params)
        self.prefetch = prefetch                   # read sub-group i+1 while i steps
        # this optimizer's own directory (two engines on one
        # nvme_path must not share files), removed with it
        self.dir = tempfile.mkdtemp(prefix=f"minizero-rank{rank}-", dir=check_nvme_path(nvme_path))
        self._removers.append(weakref.finalize(self, shutil.rmtree, self.dir, True))
        # offload_param nvme: the parameter shards' own files (None: they stay device tensors)
        self.param_dir = None if param_nvme_path is None else tempfile.mkdtemp(
            prefix=f"minizero-rank{rank}-params-", dir=check_nvme_path(param_nvme_path))
        if self.param_dir is not None:
            self._removers.append(weakref.finalize(self, shutil.rmtree, self.param_dir, True))
            self._map_params()
        self.offsets = [0]  # device param i is [offsets[i], offsets[i+1]) of the concatenation
        for p in self.device_params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.sub_group_numel = min(int(sub_group_numel), max(self.numel, 1))
        self.bounds = [(lo, min(lo + self.sub_group_numel, self.numel))
                       for lo in range(0, self.numel, self.sub_group_numel)]
        # each sub-group is swapped in here
        self._work = torch.nn.Parameter(host.zeros(1), requires_grad=False)
        self.optim = cpu_optimizer(optimizer_cls, [self._work], **optimizer_kwargs)
        self.keys = None  # elementwise state names, known after the first step
        self.scalars = {}                          # sub-group -> its scalar state (Adam's step)
        # at least 2: one reads the next sub-group while another writes the last one back
        # (aio.thread_count)
        self._pool = ThreadPoolExecutor(max_workers=max(2, io_threads),
                                        thread_name_prefix="minizero-nvme")
        self._writes = {}                          # sub-group -> its pending write
        self._lock = threading.Lock()
        self.buffer_bytes = 0  # host bytes now holding sub-groups (read, stepping, writing)
        self.buffer_peak = 0  # ... and their high-water mark (what sub_group_size buys)
        with torch.no_grad():                      # the initial masters: the model's values
            for i, (lo, hi) in enumerate(self.bounds):
                self._write(i, {"master": self._gather_device(lo, hi)})
        self._flush_writes()
        # copying the masters paged the parameter files in: out again now
        if self.param_dir is not None:
            self.release_params()
        # host fp32 gradients: one flat buffer, a view per device param (the hooks and the clip use
        # them). Allocated after the masters are written,
        # so the two never add up in the build's peak RSS.
        self.flat_grad = host_empty(self.numel, pin=pin_memory).zero_()
        self.grads = [self.flat_grad[a:b] for a, b in zip(self.offsets, self.offsets[1:])]
        self._front()

    # ------------------------------------------------------------------ files
    @torch.no_grad()
    def _map_params(self):
        """offload_param nvme: each parameter shard's storage becomes a file, mapped into memory
        (torch.from_file, MAP_SHARED). Reading it pages it in from the file, writing it goes back to
        the file, and the kernel may drop the pages once they are written back: the process keeps no
        anonymous copy between uses (FSDP's fetch_shard copies a shard out for each all-gather).
        Each file is written whole before it is mapped, so a full disk is a DiskError here, not a
        SIGBUS at a later write."""
        for i, p in enumerate(self.device_params):
            path = os.path.join(self.param_dir, f"param{i:05d}")
            self._write_file(path, p.detach().reshape(-1).contiguous())
            p.data = torch.from_file(path, shared=True, size=p.numel(), dtype=p.dtype).view(p.shape)
        self.release_params()

    def release_params(self):
        """offload_param nvme: the parameter files leave the process's memory until their next
        use."""
        for p in self.device_params:
            release_pages(p)

    def _path(self, i, key):
        return os.path.join(self.dir, f"sg{i:05d}.{key}")

    @labelled("mz.disk.write")  # profiler ranges: comm/labels.py
    def _write_file(self, path, t):
        try:
            if _write_hook is not None:
                _write_hook(path)
            t.numpy().tofile(path)
        except OSError as e:
            why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise DiskError(f"could not write {path}: {why}; free space under the nvme_path or "
                            "point it elsewhere (checkpoints are written elsewhere and stay "
                            "untouched)") from None
        self.traffic.disk_written += t.numel() * t.element_size()

    def _held(self, nbytes):
        with self._lock:
            self.buffer_bytes += nbytes
            self.buffer_peak = max(self.buffer_peak, self.buffer_bytes)

    def _write(self, i, tensors: dict):
        """Write sub-group i's tensors, in the pool (asynchronous); they stay alive until
        written."""
        self._wait_write(i)
        # bounded write-behind: an unbounded queue would hold every sub-group
        while len(self._writes) >= 2:
            self._wait_write(next(iter(self._writes)))
        name = f"nvme.write{i}"
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        memory.transient.alloc(name, nbytes)
        self._held(nbytes)

        def job():
            try:
                for key, t in tensors.items():
                    self._write_file(self._path(i, key), t)
            finally:
                memory.transient.free(name)
                self._held(-nbytes)
        self._writes[i] = self._pool.submit(job)

    def _wait_write(self, i):
        future = self._writes.pop(i, None)
        if future is not None:
            future.result()  # re-raises a DiskError from the writer

    def _flush_writes(self):
        for i in list(self._writes):
            self._wait_write(i)

    @labelled("mz.disk.read")
    def _read(self, i) -> dict:
        self._wait_write(i)
        out = {}
        stepped = i in self.scalars  # a sub-group's state files exist once it has stepped
        for key in ["master"] + (self.keys if stepped else []):
            arr = np.fromfile(self._path(i, key), dtype=np.float32)
            self.traffic.disk_read += arr.nbytes
            out[key] = host.mark(torch.from_numpy(arr))
        # released when its write-back is queued
        self._held(sum(t.numel() * 4 for t in out.values()))
        return out

    # ------------------------------------------------------------------ device <-> host pieces
    def _segments(self, lo, hi):
        """(device param index, a, b, offset): elements [a, b) of param i are [lo + offset, ...)
        here."""
        for i, (start, end) in enumerate(zip(self.offsets, self.offsets[1:])):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                yield i, a - start, b - start, a - lo

    def _gather_device(self, lo, hi):
        out = host.empty(hi - lo)
        for i, a, b, off in self._segments(lo, hi):
            out[off:off + b - a] = self.device_params[i].detach().reshape(-1)[a:b]
        return out

    # ------------------------------------------------------------------
    # the step, sub-group by sub-group
    @torch.no_grad()
    @labelled("mz.offload.cpu_step")
    def cpu_step(self, grads):
        flat = (
            torch.cat([g.reshape(-1) for g in grads]) if grads is not self.grads else self.flat_grad
        )
        pending = self._pool.submit(self._read, 0) if self.prefetch else None
        for i, (lo, hi) in enumerate(self.bounds):
            current = pending.result() if pending is not None else self._read(i)
            pending = None
            if self.prefetch and i + 1 < len(self.bounds):
                # the next sub-group, while this one steps
                pending = self._pool.submit(self._read, i + 1)
            name = f"nvme.step{i}"
            memory.transient.alloc(name, sum(t.numel() * 4 for t in current.values()))
            master = current.pop("master")
            self._work.data = master
            self._work.grad = flat[lo:hi]
            if i in self.scalars:
                self.optim.state[self._work] = {**current, **self.scalars[i]}
            self.optim.step()
            state = self.optim.state.pop(self._work, {})
            if self.keys is None:
                self.keys = sorted(
                    k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape
                )
            self.scalars[i] = {k: v for k, v in state.items() if k not in self.keys}
            self._work.grad = None
            self._work.data = host.zeros(1)
            for j, a, b, off in self._segments(lo, hi):  # parameters up, this sub-group's part
                p = self.device_params[j]
                p.view(-1)[a:b].copy_(master[off:off + b - a])
                if self.param_dir is not None:  # into the mapped file
                    self.traffic.disk_written += (b - a) * p.element_size()
                else:
                    self.traffic.to_device += (b - a) * p.element_size()
            self._write(i, {"master": master, **{k: state[k] for k in self.keys}})
            self._held(-(master.numel() * 4 + sum(v.numel() * 4 for v in current.values())))
            memory.transient.free(name)
        self._flush_writes()
        if self.param_dir is not None:
            self.release_params()

    def params_to_device(self):
        # cpu_step already copied each sub-group up as it finished
        if self.after_params is not None:
            self.after_params()

    def step(self):
        self._copy_front()
        self.steps += 1
        self.cpu_step(self.grads)
        self.params_to_device()

    # ------------------------------------------------------------------ checkpoints and state
    @property
    def masters(self):
        return self.device_params  # their values equal the masters on disk (fp32 device shards)

    def master_of(self, t):
        for p in self.device_params:
            if t is p:
                return p
        raise KeyError("not a parameter of this DiskOptimizer")

    @property
    def state(self):
        return _DiskState(self)

    @torch.no_grad()
    def sync_masters_from_device(self):
        self._flush_writes()
        for i, (lo, hi) in enumerate(self.bounds):
            self._write(i, {"master": self._gather_device(lo, hi)})
        self._flush_writes()

    def state_dict(self):
        raise NotImplementedError("DiskOptimizer: save through engine.save_checkpoint (it reads "
                                  "the files)")

    def memory_tensors(self):
        """Host gradients; the files' sizes on disk, by what they hold."""
        yield "gradients", self.flat_grad, "host"
        if self.param_dir is not None:
            for p in self.device_params:
                yield "parameters", p, "disk"
        self._flush_writes()
        for name in os.listdir(self.dir):
            category = "master_params" if name.endswith(".master") else "optimizer_state"
            yield category, os.path.getsize(os.path.join(self.dir, name)), "disk"

    def close(self):
        self._flush_writes()
        self._pool.shutdown()

    def regroup(self, runs, hypers):
        raise ValueError("the disk tier steps its sub-groups as ONE param group, got "
                         f"{len(hypers)}: pass one group (its lr / weight_decay apply), or offload "
                         "to the host (device 'cpu') instead")

    def __repr__(self):
        return (f"DiskOptimizer({type(self.optim).__name__}, {self.numel} elements in "
                f"{len(self.bounds)} sub-groups of {self.sub_group_numel} under {self.dir}, "
                f"prefetch={self.prefetch})")


class _DiskState:
    """optimizer.state for the checkpoint code: a device parameter's full state, read from (and
    written into) the sub-group files."""

    def __init__(self, owner: DiskOptimizer):
        self.owner = owner

    def _index(self, t):
        return next(i for i, p in enumerate(self.owner.device_params) if p is t)

    def get(self, t, default=None):
        owner, i = self.owner, self._index(t)
        if owner.keys is None:
            return default
        start, end = owner.offsets[i], owner.offsets[i + 1]
        out, scalars = {k: host.empty(end - start) for k in owner.keys}, {}
        for g, (lo, hi) in enumerate(owner.bounds):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                data = owner._read(g)
                owner._held(-sum(v.numel() * 4 for v in data.values()))
                for k in owner.keys:
                    out[k][a - start:b - start] = data[k][a - lo:b - lo]
                scalars = owner.scalars.get(g, {})
        out.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        return {k: v.view(t.shape) if torch.is_tensor(v) and k in owner.keys else v for k,
                v in out.items()}

    def pop(self, t, default=None):
        return default  # __setitem__ overwrites every element

    def __setitem__(self, t, state):
        owner, i = self.owner, self._index(t)
        owner.keys = sorted(
            k for k, v in state.items() if torch.is_tensor(v) and v.numel() == t.numel() and v.dim()
        )
        start, end = owner.offsets[i], owner.offsets[i + 1]
        for g, (lo, hi) in enumerate(owner.bounds):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                owner._wait_write(g)
                data = {}
                # read-modify-write: a sub-group may hold pieces of several params
                for k in owner.keys:
                    path = owner._path(g, k)
                    data[k] = (host.mark(torch.from_numpy(np.fromfile(path, dtype=np.float32)))
                               if os.path.exists(path) else host.zeros(hi - lo))
                    data[k][a - lo:b - lo] = state[k].reshape(-1)[a - start:b - start]
                owner._write(g, data)
                owner.scalars[g] = {k: v.clone() if torch.is_tensor(v) else v for k,
                                    v in state.items()
                                    if k not in owner.keys}
        owner._flush_writes()
