# Lab 07: ZeRO-Offload: gradients down, CPU step, parameters up
# GENERATED from minizero/zero/offload.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab07_offload.py
#   check: python -m minizero_course grade --lab 7 --impl solutions    (or: pytest -m lab7 --impl solutions)
"""ZeRO-Offload: the fp32 master copy and the optimizer state on the host, the step on the CPU.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC):
Sec. 3 derives the offload strategy, Sec. 4 its schedule, Sec. 5 the CPU step and the delayed
update. Mixed-precision Adam holds 2Ψ (16-bit params) + 2Ψ (16-bit grads) + 12Ψ (fp32 master, m, v).
ZeRO-Offload (built on ZeRO-2) keeps only the 2Ψ of 16-bit parameters on the device: each bucket's
16-bit gradients go to the host during backward, as soon as they are reduced, into an fp32 gradient
partition there, and the 12Ψ that only the optimizer step touches live on the host, where the step
runs on the CPU. Device model states: 16Ψ -> 2Ψ, 8x (plus the bucket buffers, which are transient).
That is the paper's headline: 13B x 2 B = 26 GB fits a 32 GB V100 with room for activations;
13B x 4 B = 52 GB would not. Each step, per rank, with this rank's shard of Ψ/N parameters
(Sec. 3.3: 4M bytes a step, the least any offload strategy moves; Sec. 4.2: each rank moves its own
partition only):

    gradients down   g_bytes·Ψ/N   (2Ψ/N in fp16)        device -> host
    parameters up    p_bytes·Ψ/N   (2Ψ/N in fp16)        host -> device
                     ----------------------------
                     4Ψ/N per rank in fp16; 4Ψ on one GPU, the paper's figure.
(With gradient accumulation ZeRO-2 sends each micro-batch's reduced gradients down.) ZeRO-3 +
offload keeps the 16-bit parameter shard on the device and the fp32 master on the host.

`HostOptimizer` is that step for any flat device tensors (ZeRO-1/2: the rank's flat shard; ZeRO-3:
each unit's shard). It counts every byte it copies in `traffic` (to_host, to_device), where it is
copied. The optimizer is torch's own, built on the host masters: `fused=True` (torch's fused CPU
Adam/AdamW/SGD, about 3x the default loop on one core) when the class accepts it.

The one-step delayed parameter update (DPU, Sec. 5.2): from step `dpu_warmup_steps` on, the CPU
step of iteration t runs in a thread while the device computes forward and backward of t+1, which
therefore uses the parameters of step t-1 (the gradient it produces is one step stale). The paper
warms up with plain steps first because early gradients change fast. `finish()` waits for the
step in flight and copies its parameters up; the engine calls it at the next boundary, before
checkpoints and at the end. The thread only computes: every collective stays on the main thread.
The schedulers see `param_groups` (a front copy), copied into the CPU optimizer when a step
starts, so an lr change never races with a step in flight.

On a CPU-only machine "device" and "host" are the same RAM: the copies are real (separate
tensors, real bytes moved) but no bus is crossed. The ledger still reports them apart
(memory_tensors gives explicit locations), which is bookkeeping there and physical on a GPU.
ZeRO-Infinity (the disk tier) is zero/infinity.py.
"""
from __future__ import annotations

import inspect
import threading

import torch

from minizero import memory
from minizero.comm.labels import labelled
from minizero.host import empty as host_empty
from minizero.host import to_host


class Traffic:
    """Bytes moved between the tiers, counted where each copy is made."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.to_host = 0       # device -> host (gradients, and parameters read by the CPU step)
        self.to_device = 0     # host -> device (updated parameters, offloaded parameter shards)
        self.disk_read = 0     # file -> host (ZeRO-Infinity)
        self.disk_written = 0  # host -> file

    def as_dict(self) -> dict:
        return dict(vars(self))


# param-group keys that are not hyperparameters: the tensors, and the kernel cpu_optimizer chose
IMPLEMENTATION = ("params", "fused", "foreach", "capturable", "differentiable")


def cpu_optimizer(optimizer_cls, params, **kwargs):
    """torch's optimizer on host tensors, fused when the class supports it (unless told
    otherwise)."""
    if "fused" in inspect.signature(optimizer_cls.__init__).parameters:
        kwargs.setdefault("fused", True)
    return optimizer_cls(params, **kwargs)


class OffloadedOptimizer:
    """What every tier off the device shares (HostOptimizer here, infinity.DiskOptimizer): the
    device tensors it updates, the bytes it moves, the front param groups schedulers edit, the step
    count, the delayed update in flight. A tier builds its masters and its torch optimizer, then
    calls _front()."""

    def __init__(self, device_params, traffic: Traffic | None = None, pin_memory: bool = False,
                 dpu_warmup_steps: int | None = None, after_params=None):
        self.device_params = list(device_params)  # the flat tensors forward reads, on the device
        self.traffic = traffic or Traffic()       # bytes copied between tiers (the PCIe traffic)
        self.pin_memory = pin_memory  # page-locked host buffers (CUDA only; a no-op on CPU)
        # None: no DPU; k: steps 0..k-1 plain, then delayed
        self.dpu_warmup_steps = dpu_warmup_steps
        # called after parameters reach the device (ZeRO-1/2 all-gather)
        self.after_params = after_params
        self._spare = None  # DPU: the second gradient buffer (the other is being stepped)
        self.steps = 0                            # CPU steps started
        self._thread = None                       # DPU: the step in flight
        self._error = None                        # an exception raised inside it

    @torch.no_grad()
    def accumulate(self, i: int, grad: torch.Tensor, offset: int = 0):
        """Add one device gradient into host buffer i at `offset` (ZeRO-3's hooks call this as each
        unit's gradient is reduced, ZeRO-2 as each bucket's is: it moves during backward, in the
        device's width, and micro-batches add up on the host in fp32)."""
        flat = grad.reshape(-1)
        self.grads[i][offset:offset + flat.numel()].add_(to_host(flat, torch.float32))
        self.traffic.to_host += grad.numel() * grad.element_size()

    @property
    def delayed(self) -> bool:
        """Whether the next step() is a delayed (DPU) one."""
        return self.dpu_warmup_steps is not None and self.steps >= self.dpu_warmup_steps

    def _front(self):
        """What LR schedulers write; copied into self.optim when a step starts (no race with DPU's
        thread)."""
        self.param_groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups
        ]

    def _copy_front(self):
        # lr, weight_decay, ... (not the
        for front, back in zip(self.param_groups, self.optim.param_groups):
            # tensors, nor the kernel
            back.update((k, v) for k, v in front.items() if k not in IMPLEMENTATION)

    def finish(self):
        """Wait for a delayed step in flight and copy its parameters to the device (a no-op
        otherwise)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the delayed CPU optimizer step failed: {error}") from error
        self.params_to_device()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def zero_grad(self):
        for g in self.grads:
            g.zero_()


class HostGradShard:
    """ZeRO-2's gradient shard when offloaded (Ren et al. 2021, Sec. 4.2): `shard[lo:hi].add_(part)`
    copies the reduced bucket part down into the tier's fp32 host gradient at lo (counted in
    traffic.to_host) instead of adding it into a device buffer, so no gradient outlives backward on
    the device: it holds the 16-bit parameters and the bucket buffers only."""

    def __init__(self, tier: OffloadedOptimizer, dtype: torch.dtype, device, index: int = 0):
        self.tier = tier      # whose host gradient buffer receives the parts
        self.dtype = dtype  # the device gradients' type (the buckets are allocated like the shard)
        self.device = device  # ... and where they are
        self.index = index    # which of the tier's buffers (ZeRO-1/2: the one flat shard)

    def __getitem__(self, window: slice):
        return _HostWindow(self.tier, self.index, window.start or 0)

    @property
    def host(self) -> torch.Tensor:
        """The fp32 host buffer the parts were added into: the gradient the step uses."""
        return self.tier.grads[self.index]

    def zero_(self):
        self.host.zero_()
        return self


class _HostWindow:
    def __init__(self, tier, index, offset):
        self.tier, self.index, self.offset = tier, index, offset

    def add_(self, part):
        self.tier.accumulate(self.index, part, self.offset)


class HostOptimizer(OffloadedOptimizer):
    """fp32 masters, gradients and optimizer state of `device_params` on the host; steps on the
    CPU."""

    def __init__(self, device_params, optimizer_cls, traffic: Traffic | None = None,
                 pin_memory: bool = False, dpu_warmup_steps: int | None = None, after_params=None,
                 **optimizer_kwargs):
        super().__init__(device_params, traffic, pin_memory, dpu_warmup_steps, after_params)
        # host fp32 master copies: the optimizer steps
        # these (the initial copy is the model's values)
        self.masters = [host_empty(p.numel(), pin=pin_memory) for p in self.device_params]
        with torch.no_grad():
            for m, p in zip(self.masters, self.device_params):
                m.copy_(p.detach().reshape(-1))
        self.grads = self._zeros()  # host fp32 gradients, filled by grads_to_host / accumulate
        # regroup() rebuilds the CPU optimizer with the same class ...
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = optimizer_kwargs  # ... and keywords
        self.optim = cpu_optimizer(optimizer_cls, self.masters, **optimizer_kwargs)
        self._front()

    def regroup(self, runs, hypers):
        """Several param groups (nanoGPT's decay / no-decay): runs = [(master index, lo, hi, group)]
        tiling the masters, hypers = each group's lr, weight_decay, ... The CPU optimizer then steps
        views of the masters, a param group per user group (DeepSpeed's CPU Adam takes the groups
        the same way)."""
        self.optim = RunGroups(self.masters, runs, hypers,
                               lambda groups: cpu_optimizer(self.optimizer_cls, groups,
                                                            **self.optimizer_kwargs))
        self._front()

    def _zeros(self):
        return [torch.zeros_like(m) for m in self.masters]

    # ------------------------------------------------------------------ the offloaded step (lab 07)
    @torch.no_grad()
    @labelled("mz.offload.d2h")  # profiler ranges: comm/labels.py
    def grads_to_host(self, device_grads):
        """Copy each reduced device gradient (any dtype) into its host fp32 buffer, counting the
        bytes."""
        # gradients down: device -> host.
        #   Invariant: afterwards self.grads[i] holds device gradient i exactly, in fp32, and
        #   self.grads are the SAME buffers every step (allocated once, counted by the ledger,
        #   pinned on a GPU; DPU alternates two sets). ZeRO-3 hands one tensor per unit: all of
        #   them. What crosses the bus is the DEVICE width, g_bytes * numel per tensor (2 in
        #   fp16/bf16), summed over the tensors into self.traffic.to_host.
        for host, g in zip(self.grads, device_grads):
            host.copy_(g.reshape(-1))
            self.traffic.to_host += g.numel() * g.element_size()

    @torch.no_grad()
    @labelled("mz.offload.cpu_step")
    def cpu_step(self, grads):
        """One step of the CPU optimizer on the host masters, with host gradients `grads`."""
        # the CPU step.
        #   The torch optimizer steps the host masters, so EVERY master needs its own gradient
        #   as .grad: the `grads` given, which under DPU are not self.grads (those are already
        #   being filled by the next backward). One optimizer step per training step; then drop
        #   the .grad references (the buffers live on in `grads`).
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.optim.step()
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    @labelled("mz.offload.h2d")
    def params_to_device(self):
        """Copy the updated masters into the device parameters (cast to their dtype), counting the
        bytes."""
        # parameters up: host -> device.
        #   The device tensors are what forward reads, and the model's weights are views of
        #   their memory: the updated masters must land IN that memory, in the device dtype, not
        #   in new tensors. Bytes: p_bytes * numel per tensor into self.traffic.to_device; with
        #   the gradients down that is 4 Psi / N per rank in 16 bits (Ren et al. 2021, Sec. 3.3, 4.2).
        for p, m in zip(self.device_params, self.masters):
            p.copy_(m.view(p.shape))
            self.traffic.to_device += p.numel() * p.element_size()
        if self.after_params is not None:
            self.after_params()

    # ------------------------------------------------------------------ driving it
    def step(self):
        """After grads_to_host (and unscaling/clipping the host grads): step and update the device.
        Under DPU the step runs in a thread and the device parameters change at finish()."""
        self.finish()
        self._copy_front()
        self.steps += 1
        if not (self.dpu_warmup_steps is not None and self.steps > self.dpu_warmup_steps):
            self.cpu_step(self.grads)
            self.params_to_device()
            return
        # DPU, the delayed step in a thread (stretch task, extra points).
        #   Ren et al. 2021, Sec. 5.2: the CPU step of iteration t overlaps forward and backward
        #   of t+1, which computes with t-1's parameters. Run it in a thread (target self._run,
        #   kept in self._thread: finish() joins it and copies the parameters up at the next
        #   step). Meanwhile the next backward fills self.grads, so the thread must own the
        #   buffer it steps and self.grads must become the other one (self._spare, made once,
        #   counted as memory.transient "offload.dpu_grads"). Collectives stay on this thread.
        grads = self.grads  # stepped in the thread; backward of the next iteration fills the other buffer
        if self._spare is None:
            self._spare = self._zeros()
            memory.transient.alloc("offload.dpu_grads", sum(g.numel() * 4 for g in self._spare))
        self.grads, self._spare = self._spare, grads
        self._thread = threading.Thread(target=self._run, args=(grads,), name="minizero-dpu", daemon=True)
        self._thread.start()

    def _run(self, grads):
        try:
            self.cpu_step(grads)
        except BaseException as e:  # noqa: BLE001  re-raised on the main thread by finish()
            self._error = e

    # ------------------------------------------------------------------ checkpoints and state
    @property
    def state(self):
        """The CPU optimizer's state, keyed by the host masters (or by their device tensors)."""
        return _StateView(self, self.optim.state)

    def master_of(self, t):
        """The host master of a device parameter (or the master itself)."""
        for p, m in zip(self.device_params, self.masters):
            if t is p or t is m:
                return m
        raise KeyError("not a parameter of this HostOptimizer")

    @torch.no_grad()
    def sync_masters_from_device(self):
        """After loading the device parameters from a checkpoint: the masters follow (exact in
        fp32)."""
        self.finish()
        for m, p in zip(self.masters, self.device_params):
            m.copy_(p.detach().reshape(-1))

    def state_dict(self) -> dict:
        self.finish()
        return {"masters": [m.clone() for m in self.masters], "optimizer": self.optim.state_dict(),
                "steps": self.steps}

    def load_state_dict(self, sd: dict):
        self.finish()
        with torch.no_grad():
            for m, saved in zip(self.masters, sd["masters"]):
                m.copy_(saved)
        self.optim.load_state_dict(sd["optimizer"])
        self.steps = sd["steps"]
        self.params_to_device()

    def memory_tensors(self):
        """Masters, gradients and optimizer state, all on the host; the device parameters are the
        wrapper's to report."""
        for m, g in zip(self.masters, self.grads):
            yield "master_params", m, "host"
            yield "gradients", g, "host"
        for g in self._spare or ():
            yield "gradients", g, "host"
        for state in self.optim.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer_state", v, "host"

    def __repr__(self):
        numel = sum(m.numel() for m in self.masters)
        return (f"HostOptimizer({type(self.optim).__name__}, {len(self.masters)} tensors, {numel} "
                f"elements on the host, dpu_warmup_steps={self.dpu_warmup_steps})")


class RunGroups:
    """The CPU optimizer of a tier whose masters hold several param groups: one torch optimizer over
    views of the masters (a run each), a param group per user group. cpu_step sets each MASTER's
    .grad as with one group; step() hands every view its slice of it. `state` is keyed by the
    masters, as the checkpoint code and HostOptimizer.state expect: a master's state is its views'
    state, put end to end."""

    def __init__(self, masters, runs, hypers, make):
        self.masters = masters
        # (master, lo, hi, view) per run, in master order: the views tile each master
        self.views = [(masters[index], lo, hi, masters[index].detach()[lo:hi])
                      for index, lo, hi, _ in sorted(runs, key=lambda run: (run[0], run[1]))]
        group_of = {id(view): group for (_, _, _, view), (_, _, _, group) in
                    zip(self.views, sorted(runs, key=lambda run: (run[0], run[1])))}
        self.inner = make([{**hyper,
                            "params": [view for *_, view in self.views if group_of[id(view)] == g]}
                           for g, hyper in enumerate(hypers)])
        self.param_groups = self.inner.param_groups
        self.state = _MasterState(self)

    @torch.no_grad()
    def step(self):
        for master, lo, hi, view in self.views:
            view.grad = None if master.grad is None else master.grad[lo:hi]
        self.inner.step()
        for *_, view in self.views:
            view.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict):
        self.inner.load_state_dict(sd)


class _MasterState:
    """RunGroups' optimizer state by master: tensors shaped like the views are concatenated (split
    on write), the rest (Adam's step count, the same for every view) is taken from the first
    view."""

    def __init__(self, owner):
        self.owner = owner

    def _views(self, master):
        return [view for m, _, _, view in self.owner.views if m is master]

    def get(self, master, default=None):
        states = [self.owner.inner.state.get(view) for view in self._views(master)]
        if not states or any(not state for state in states):
            return default
        return {
            k: torch.cat([state[k] for state in states])
            if torch.is_tensor(v) and v.dim() > 0
            else v
            for k, v in states[0].items()
        }

    def pop(self, master, default=None):
        state = self.get(master, default)
        for view in self._views(master):
            self.owner.inner.state.pop(view, None)
        return state

    def __setitem__(self, master, state):
        for view in self._views(master):
            lo = view.storage_offset() - master.storage_offset()
            self.owner.inner.state[view] = {
                k: v[lo : lo + view.numel()].clone()
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel()
                else v
                for k, v in state.items()
            }

    def __getitem__(self, master):
        state = self.get(master)
        if state is None:
            raise KeyError("no optimizer state for this master")
        return state

    def __contains__(self, master):
        return self.get(master) is not None

    def values(self):
        return self.owner.inner.state.values()


class _StateView:
    """optimizer.state as the checkpoint code uses it, accepting device tensors as keys too."""

    def __init__(self, owner, state):
        self.owner, self.state = owner, state

    def _key(self, t):
        return self.owner.master_of(t)

    def get(self, t, default=None):
        return self.state.get(self._key(t), default)

    def pop(self, t, default=None):
        return self.state.pop(self._key(t), default)

    def __setitem__(self, t, value):
        self.state[self._key(t)] = value

    def __getitem__(self, t):
        return self.state[self._key(t)]

    def __contains__(self, t):
        return self._key(t) in self.state

    def values(self):
        return self.state.values()


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(7, globals())
