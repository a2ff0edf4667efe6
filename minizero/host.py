"""Host memory: the tensors an offload tier keeps off the device, and a strict mode that tells them
apart.

On a GPU, ZeRO-Offload's masters, gradients and optimizer state are CPU tensors while the model and
the communicator are on CUDA: a host tensor handed to an NCCL collective fails
(`all_reduce: tensor on cpu, communicator world is on cuda:0`). On a CPU-only machine host and
device are the same RAM and the same `torch.device("cpu")`, so nothing there would catch that bug.
MINIZERO_STRICT_HOST=1 (the test suite's strict mode) makes every host tensor the tiers allocate a
`HostTensor`: a plain subclass, which torch hands on to every tensor computed from it, so anything
derived from host data stays marked until it is moved with `.to(device)`. The communicator refuses a
marked tensor as NCCL refuses a CPU one (comm/communicator.py `_enter`). Unmarked, i.e. without the
variable, nothing changes: plain tensors.

The marks follow data, not devices: a device tensor into which host data was copied in place
(`p.copy_(master)`) stays the device's, as on a GPU, and `.to("cpu")` of a host tensor counts as a
move (on CPU no test can tell it from `.to(device)`): the mode finds host data reaching a
collective, never the reverse.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from minizero import env as mz_env


# strict mode's name for the host: what a marked tensor's .device says
HOST = torch.device("cpu", 0)


class HostTensor(torch.Tensor):
    """A host tensor under MINIZERO_STRICT_HOST=1. Whatever is computed from one is one too; its
    .device is HOST, so a tensor made `device=t.device` is one too (_Factories); `.to(device)` and
    `.cuda()` give a plain tensor (the device's); saved as a plain tensor, so a checkpoint loads
    anywhere."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return HOST
        if func in (torch.Tensor.to, torch.Tensor.cuda) and _target(func, args[1:], kwargs) not in (
            None,
            HOST,
        ):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, HostTensor) else out
        on_host = host_side(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return torch._tensor._convert(out, cls) if on_host else out

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


# what may take host and device tensors at once, as on a GPU (a copy crosses the bus)
_TRANSFERS = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.__setitem__,
              torch.Tensor.set_}


def host_side(func, args, kwargs) -> bool:
    """Whether an op's result is host data; raises as torch does on a GPU for an op given host and
    device tensors (a 0-dim host tensor is a scalar there, allowed with device tensors, and the
    result is the device's). A copy crosses the bus and its result is its destination's."""
    if func in _TRANSFERS:
        return isinstance(args[0], HostTensor)
    tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(a)]
    host = [t for t in tensors if isinstance(t, HostTensor)]
    device = [t for t in tensors if not isinstance(t, HostTensor) and t.device.type != "meta"]
    if host and device and (any(t.dim() for t in host) or not any(t.dim() for t in device)):
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(f"{name}: expected all tensors to be on the same device, but found host "
                           "and device tensors (MINIZERO_STRICT_HOST=1: on a GPU, cpu and cuda:0)")
    return not device


def _target(func, args, kwargs):
    """The device a call names (a .to()/.cuda() target or a factory's device=), HOST for the host;
    None: none."""
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    named = [kwargs["device"]] if kwargs.get("device") is not None else []
    if func is torch.Tensor.to:
        named += [a if isinstance(a, (str, torch.device)) else a.device for a in args
                  if isinstance(a, (str, torch.device)) or torch.is_tensor(a)]
    if not named:
        return None
    where = named[0] if isinstance(named[0], torch.device) else torch.device(named[0])
    return HOST if where == HOST else where


class _Factories(TorchFunctionMode):
    """Strict mode: a tensor made on HOST (`torch.zeros(1, device=host_tensor.device)`,
    `x.to(host.device)`) is a HostTensor, as on a GPU it would be a CPU tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_tensor(out) and not isinstance(out, HostTensor) and \
                _target(func, args[1:] if func is torch.Tensor.to else (), kwargs) == HOST:
            out = out.as_subclass(HostTensor)
        return out


_MODE = []  # the _Factories mode, entered once for the process when the first host tensor is marked


def strict() -> bool:
    """Whether host tensors are marked (MINIZERO_STRICT_HOST=1)."""
    return mz_env.get("MINIZERO_STRICT_HOST")


def mark(t: torch.Tensor) -> torch.Tensor:
    """`t` (a host tensor) as a HostTensor in strict mode; `t` itself otherwise."""
    if not strict() or isinstance(t, HostTensor):
        return t
    if not _MODE:
        _MODE.append(_Factories())
        _MODE[0].__enter__()  # for the rest of the process: marked tensors outlive any scope
    return t.as_subclass(HostTensor)


def is_host(t: torch.Tensor) -> bool:
    """Whether `t` holds host data (always False outside strict mode)."""
    return isinstance(t, HostTensor)


def empty(numel: int, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
    """A host buffer; page-locked when `pin` and CUDA exist, so copies can be asynchronous."""
    return mark(torch.empty(numel, dtype=dtype, pin_memory=pin and torch.cuda.is_available()))


def zeros(numel: int, dtype=torch.float32) -> torch.Tensor:
    return mark(torch.zeros(numel, dtype=dtype))


def to_host(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """`t` copied to the host (a no-op copy on CPU), marked in strict mode. The explicit form of
    `.to(host_tensor.device)`, which strict mode cannot see inside autograd's hooks (no mode runs
    there)."""
    return mark(t.to("cpu", dtype or t.dtype))
