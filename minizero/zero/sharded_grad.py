"""ShardedGrad: a parameter's .grad that knows it is one rank's part of the averaged gradient.

torch's own clip line, `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` (nanoGPT's), takes
each .grad's norm (torch.linalg.vector_norm, or torch._foreach_norm), stacks them into the total
norm and multiplies every .grad by one coefficient. Under ZeRO a .grad is not the averaged full
gradient: ZeRO-1's is this rank's unreduced one, ZeRO-2 frees it during backward, FSDP's is this
rank's local part. torch's FSDP2 gets the line right because its gradients are DTensors, whose norm
is a collective. A ShardedGrad does the same for the two operations the clip uses (a
__torch_function__ subclass, as DTensor is):

  * a norm of the whole tensor (torch.linalg.vector_norm / norm, torch.norm, Tensor.norm,
    _foreach_norm) is the norm of the parameter's AVERAGED gradient: this rank's sum of |g|^p over
    the averaged elements it holds, all-reduced (max for p = inf). One scalar all-reduce per
    parameter, so every rank's clip must visit the same parameters (their .grad are set alike on
    every rank); a wrapper's own clip_grad_norm_ does one all-reduce in all. A norm over `dim` is
    refused: the tensor is a shard.
  * mul_ / div_ (the clip's scaling; a manual unscale) scale the averaged elements this rank holds,
    where they are not the tensor itself (ZeRO-1's reduced shard, ZeRO-2's gradient shard), and the
    tensor.
  * full_tensor() (DTensor's name) all-gathers the parameter's whole averaged gradient, full shape;
    to_local() is this rank's piece as a plain tensor (FSDP's shard_layout="per_param": FSDP2's
    dim-0 piece).
  * everything else runs on the tensor as it is (ZeRO-1: this rank's local gradient; FSDP: its local
    part), except on ZeRO-2's placeholder, which holds no values (one element of storage, expanded):
    there any other use is an error naming the wrapper's gradient shard.
"""
from __future__ import annotations

import math

import torch

_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm}
_SCALES = {torch.Tensor.mul_: False, torch.Tensor.div_: True}
_FOREACH_SCALES = {torch._foreach_mul_: torch.Tensor.mul_, torch._foreach_div_: torch.Tensor.div_}
# what a placeholder answers without values: its metadata (properties come as __get__)
_METADATA = {"__get__", "size", "dim", "numel", "stride", "is_floating_point", "is_complex",
             "element_size", "__hash__", "__format__", "data_ptr", "untyped_storage",
             "is_contiguous", "requires_grad_"}


class ShardedGrad(torch.Tensor):
    """Made by sharded_grad(); see the module docstring."""

    def full_tensor(self) -> torch.Tensor:
        """DTensor's name: the parameter's whole averaged gradient, full shape, on every rank (a
        collective when the elements are spread over the ranks)."""
        if self._mz_full is None:  # every rank holds all of it
            with torch._C.DisableTorchFunctionSubclass():
                return self.clone()
        return self._mz_full()

    def to_local(self) -> torch.Tensor:
        """DTensor's name: this rank's piece as a plain tensor (a view, no communication)."""
        if self._mz_placeholder:
            raise RuntimeError(f"p.grad.to_local(): this .grad holds no values, {self._mz_where}")
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refused = next(
            (
                t._mz_refuse
                for a in (*args, *kwargs.values())
                for t in (a if isinstance(a, (list, tuple)) else [a])
                if isinstance(t, ShardedGrad) and t._mz_refuse
            ),
            None,
        )
        if refused and getattr(func, "__name__", "") not in _METADATA:
            raise RuntimeError(f"{getattr(func, '__name__', func)} on p.grad: {refused}")
        if func in _NORMS and isinstance(args[0], ShardedGrad):
            return _norm(func, *args, **kwargs)
        if func is torch._foreach_norm:
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            return [_norm(torch.linalg.vector_norm, t, ord_) if isinstance(t, ShardedGrad)
                    else torch.linalg.vector_norm(t, ord_) for t in args[0]]
        if func in _FOREACH_SCALES:
            scalars = args[1] if isinstance(args[1], (list, tuple)) else [args[1]] * len(args[0])
            for t, s in zip(args[0], scalars):
                _FOREACH_SCALES[func](t, s)
            return None
        if func in _SCALES and isinstance(args[0], ShardedGrad):
            g, factor = args[0], args[1]
            if g._mz_scale is not None:
                g._mz_scale(factor, _SCALES[func])
            if g._mz_placeholder:
                return g
        elif any(
            isinstance(a, ShardedGrad) and a._mz_placeholder for a in (*args, *kwargs.values())
        ):
            if func is torch.Tensor.__repr__:
                return (f"ShardedGrad(placeholder of shape {tuple(args[0].shape)}: "
                        f"{args[0]._mz_where})")
            if getattr(func, "__name__", "") not in _METADATA:
                raise RuntimeError(
                    f"{getattr(func, '__name__', func)} on p.grad: this .grad holds "
                    f"no values, {args[0]._mz_where}. "
                    "torch.nn.utils.clip_grad_norm_ and p.grad.mul_ / div_ work on "
                    "it (they reach the shard), and p.grad.full_tensor() gathers it."
                )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def sharded_grad(tensor: torch.Tensor, comm, elements=None, scale=None, full=None,
                 placeholder: bool = False, where: str = "", refuse: str = "") -> ShardedGrad:
    """`tensor` as a ShardedGrad. comm: whose ranks hold the other elements (None: every rank holds
    them all, a replicated gradient, no collective). elements(): this rank's averaged elements of
    the parameter (default [the tensor]). scale(factor, divide): scales those elements when they are
    not the tensor itself. full(): the whole averaged gradient (full_tensor(); None: the tensor is
    it). placeholder: the tensor holds no values; `where` says where they are. refuse: every use but
    metadata raises this message (a gradient that is nowhere this rank can reach it, e.g. already on
    an offload tier)."""
    g = tensor.as_subclass(ShardedGrad)
    g._mz_comm, g._mz_elements, g._mz_scale, g._mz_full = comm, elements, scale, full
    g._mz_placeholder, g._mz_where, g._mz_refuse = placeholder, where, refuse
    return g


def placeholder_grad(
    param: torch.Tensor, comm, elements, scale, full, where: str, refuse: str = ""
) -> ShardedGrad:
    """A .grad of param's shape, dtype and device on one element of storage (expanded)."""
    base = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    return sharded_grad(base, comm, elements, scale, full, placeholder=True, where=where,
                        refuse=refuse)


def is_placeholder(t) -> bool:
    return isinstance(t, ShardedGrad) and t._mz_placeholder


@torch.no_grad()
def _norm(func, g: ShardedGrad, ord_=None, dim=None, keepdim=False, *, p=None, dtype=None,
          out=None):
    """The norm of the averaged gradient g stands for (torch.norm's p, the linalg ord; 2 by
    default)."""
    if p is not None:
        ord_ = p
    if ord_ is None or ord_ == "fro":
        ord_ = 2.0
    if dim is not None or out is not None or isinstance(ord_, str):
        raise ValueError(f"{func.__name__} of a sharded .grad: only the norm of the whole tensor "
                         f"(dim=None) is the averaged gradient's; got dim={dim}, ord={ord_!r}. "
                         "Gather the gradient first.")
    ord_ = float(ord_)
    if not ord_ > 0:
        raise ValueError(f"{func.__name__} of a sharded .grad: ord must be > 0 or inf, got {ord_}")
    with torch._C.DisableTorchFunctionSubclass():
        parts = [
            t.reshape(-1).float() for t in (g._mz_elements() if g._mz_elements is not None else [g])
        ]
        parts = [t for t in parts if t.numel()]
        device = g.device
        if ord_ == math.inf:
            local = (
                torch.stack([t.abs().max() for t in parts]).max()
                if parts
                else torch.zeros((), device=device)
            )
        else:
            local = torch.stack([t.abs().pow(ord_).sum() for t in parts]).sum() if parts else \
                torch.zeros((), device=device)
        total = local.reshape(1).to(device)
        if g._mz_comm is not None:
            g._mz_comm.all_reduce(total, op="max" if ord_ == math.inf else "sum")
        norm = total[0] if ord_ == math.inf else total[0].pow(1.0 / ord_)
        norm = norm.to(dtype or g.dtype)
        return norm.reshape([1] * g.dim()) if keepdim else norm
