"""zero.Init: build a ZeRO-3 model so that no rank ever holds all of it.

DeepSpeed's `deepspeed.zero.Init` (Rajbhandari et al. 2021, ZeRO-Infinity Sec. 7.1, "memory-centric
tiling" and partitioned initialization) shards each module's parameters as soon as its constructor
returns. minizero does it with the meta device and a replay:

    with zero.Init():                    # parameters are created on the meta device: no memory
        model = build_model("tiny-gpt")  # its init code runs as usual ...
    fsdp = FSDP(model)  # ... and FSDP materializes one unit at a time, keeps its shard

While the context is open, a TorchDispatchMode sees every aten op on a meta tensor and records a
recipe per storage: the op that created it (torch.empty, torch.linspace, a clone of another meta
tensor, ...) and every in-place op applied to it (normal_, fill_, uniform_, mul_, copy_ from another
meta tensor ...), each with the view it acted through. Random ops also record the state of the
generator they drew from (their own `generator=` or torch's default) and are run once for real on
a throwaway tensor of the same shape, so the generator advances exactly as in a whole build: the
model's own init code, global RNG or a private torch.Generator (minizero/models.py uses both, the
first inside fork_rng), needs no change. `materialize(t)` replays t's storage on the CPU with the
recorded generator states: bitwise the values a whole build would have produced, one tensor at a
time. Peak memory: the largest unit FSDP materializes, never the whole model.

Limits (each a clear error at materialization, never a silent wrong value): an op that writes two
tensors at once, and dtype-changing views of a storage. Ops that only read meta tensors (a norm,
a comparison) cannot give real values during the build: code that branches on them fails there.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_DEFAULT = "default"  # the generator was torch's default CPU generator


def _key(t):
    return t.untyped_storage()._cdata


class _Ref:
    """A meta tensor used as an argument: its storage, its view, and how many ops it had seen."""
    __slots__ = ("key", "size", "stride", "offset", "version")

    def __init__(self, t, version):
        self.key, self.size, self.stride, self.offset, self.version = \
            _key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(), version


class _Recipe:
    def __init__(self, dtype, numel):
        self.dtype = dtype      # one dtype per storage (a view with another dtype is refused)
        self.numel = numel      # elements of the storage
        # (func, args, kwargs, rng): the op that produced it; None: uninitialized
        self.creator = None
        self.ops = []           # (func, target view, args, kwargs, rng) in order
        self.error = None       # why it cannot be replayed, if it cannot


class Recorder(TorchDispatchMode):
    """The dispatch mode behind Init: recipes for every meta storage created or written."""

    def __init__(self):
        super().__init__()
        self.recipes = {}       # storage key -> _Recipe
        self.keep = []          # the meta tensors seen: keeps their storages (and keys) alive
        # materialize(t) casts to this and back (engine: fp16 rounding as .to(fp16))
        self.dtype = None

    def _ref(self, t):
        rec = self.recipes.get(_key(t))
        if rec is None:
            rec = self.recipes[_key(t)] = _Recipe(t.dtype,
                                                  t.untyped_storage().nbytes() // t.element_size())
            self.keep.append(t)
        return _Ref(t, len(rec.ops))

    def _encode(self, x):
        return self._ref(x) if torch.is_tensor(x) and x.is_meta else x

    @staticmethod
    def _rng(func, kwargs):
        """The generator state a random op will draw from, or None for a deterministic op."""
        if not any(a.name == "generator" for a in func._schema.arguments):
            return None
        gen = kwargs.get("generator")
        return (_DEFAULT, torch.get_rng_state()) if gen is None else (gen, gen.get_state())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rng = self._rng(func, kwargs)
        # draw for real, on a throwaway tensor, so the generator advances as in a whole build
        if rng is not None:
            real = tree_map(lambda x: torch.empty_strided(x.size(), x.stride(), dtype=x.dtype)
                            if torch.is_tensor(x) and x.is_meta else x, (args, kwargs))
            real[1].pop("device", None)
            func(*real[0], **real[1])
        out = func(*args, **kwargs)
        written = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None
                   and a.alias_info.is_write]
        enc_args, enc_kwargs = tree_map(self._encode, (args, kwargs))
        # a fresh generator in this state draws the same numbers
        stored_rng = None if rng is None else rng[1]
        if written:
            target = args[written[0]] if written[0] < len(args) else None
            if torch.is_tensor(target) and target.is_meta:
                ref = self._ref(target)
                rec = self.recipes[ref.key]
                if len(written) > 1 or target.dtype != rec.dtype:
                    rec.error = (
                        rec.error
                        or f"{func} writes it through "
                        f"{'two outputs' if len(written) > 1 else 'a view of another dtype'}"
                    )
                rec.ops.append((func, written[0], enc_args, enc_kwargs, stored_rng))
            return out
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if torch.is_tensor(o) and o.is_meta and _key(o) not in self.recipes:
                rec = self.recipes[_key(o)] = _Recipe(
                    o.dtype, o.untyped_storage().nbytes() // o.element_size()
                )
                self.keep.append(o)
                rec.creator = (func, enc_args, enc_kwargs, stored_rng,
                               (tuple(o.size()), tuple(o.stride()), o.storage_offset()))
        return out

    # ------------------------------------------------------------------ replay
    def _value(self, ref: _Ref, cache) -> torch.Tensor:
        return self._storage(ref.key, ref.version, cache).as_strided(ref.size, ref.stride,
                                                                     ref.offset)

    def _decode(self, x, cache):
        return self._value(x, cache) if isinstance(x, _Ref) else x

    def _run(self, func, args, kwargs, rng, cache):
        args, kwargs = tree_map(lambda x: self._decode(x, cache), (args, kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        if rng is not None:
            gen = torch.Generator()
            gen.set_state(rng)
            kwargs["generator"] = gen
        return func(*args, **kwargs)

    def _storage(self, key, upto, cache) -> torch.Tensor:
        """The storage's flat values after its first `upto` ops (None: all)."""
        rec = self.recipes[key]
        if rec.error:
            raise RuntimeError(f"zero.Init cannot rebuild this tensor: {rec.error}. Build the "
                               "model without zero.Init, or initialize that tensor in place")
        upto = len(rec.ops) if upto is None else upto
        if (key, upto) in cache:
            return cache[key, upto]
        base = torch.empty(rec.numel, dtype=rec.dtype)
        if rec.creator is not None:
            func, args, kwargs, rng, (size, stride, offset) = rec.creator
            made = self._run(func, args, kwargs, rng, cache)
            base.as_strided(size, stride, offset).copy_(made)
        for func, index, args, kwargs, rng in rec.ops[:upto]:
            args = list(args)
            target = args[index]
            args[index] = base.as_strided(target.size, target.stride, target.offset)
            self._run(func, tuple(args), kwargs, rng, cache)
        cache[key, upto] = base
        return base

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """The real (CPU) value of meta tensor t, bitwise what a whole build would hold."""
        if not t.is_meta:
            return t
        if _key(t) not in self.recipes:
            raise RuntimeError("zero.Init: this meta tensor was not created inside the zero.Init "
                               "context")
        value = self._value(_Ref(t, None), {}).clone()
        if self.dtype is not None and value.is_floating_point():
            # rounded as the whole model's .to(dtype) would be
            value = value.to(self.dtype).to(t.dtype)
        return value

    @torch.no_grad()
    def materialize_replicated(self, module: torch.nn.Module, trainable: bool = False):
        """Buffers and frozen parameters (every rank keeps them whole) become real, in place.
        trainable=True: the trainable parameters too (a whole model, for tests and small runs)."""
        for m in module.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = self.materialize(b)
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_meta and (trainable or not p.requires_grad):
                    m._parameters[name] = torch.nn.Parameter(self.materialize(p),
                                                             requires_grad=p.requires_grad)


# every Init's recorder; built_with_init finds a model's by its parameters' storages
_RECORDERS = []


class Init:
    """`with zero.Init(): model = ...` builds the model on the meta device and records how to
    rebuild each tensor; FSDP (and the engine at stage 3) materialize from it unit by unit."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # DeepSpeed's switch: Init(enabled=False) is a plain build
        self.recorder = None

    def __enter__(self):
        if self.enabled:
            self.recorder = Recorder()
            _RECORDERS.append(self.recorder)
            self._device = torch.device("meta")
            self._device.__enter__()
            self.recorder.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.recorder.__exit__(*exc)
            self._device.__exit__(*exc)
        return False



def built_with_init(module: torch.nn.Module):
    """The Recorder of a model built under zero.Init, None for a normal model."""
    meta = [p for p in module.parameters() if p.is_meta] + [
        b for b in module.buffers() if b.is_meta
    ]
    if not meta:
        return None
    for recorder in reversed(_RECORDERS):
        if _key(meta[0]) in recorder.recipes:
            return recorder
    raise ValueError("the model has tensors on the meta device that no zero.Init recorded: build "
                     "it inside `with minizero.zero.Init(): model = ...`")
