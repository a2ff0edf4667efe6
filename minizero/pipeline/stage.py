"""Stages: which layers a rank holds, and the pipes between ranks.

A model enters the pipeline as a `PipelineModel`: an `embed` module (inputs -> hidden), a list
of `blocks` (hidden -> hidden) and a `head` (hidden -> outputs), plus the `loss_fn` that turns the
head's outputs and the targets into the mean loss of a micro-batch. Nothing else is assumed of
what the modules do inside (a tensor-parallel block is a block too).

Partition. The blocks are cut into S = p·v contiguous virtual stages of equal block count (the
DeepSpeed `partition_method="uniform"`); the embedding joins virtual stage 0, the head the last.
Rank r of the pipeline holds virtual stages r, r+p, ..., r+(v-1)p (Megatron's interleaved
placement; v = 1 is the plain one). Interleaving needs the blocks to divide into S equal chunks.

Tied weights (Press & Wolf 2017; GPT-2's wte = lm_head): a Parameter that `embed` and `head` share
lives on two ranks once they are split. Megatron keeps the two copies equal by all-reducing their
gradients between the first and last stage after each step's backward (its "embedding group"):
each copy then takes the same step from the same value. Found here by identity (the same Parameter
object in embed and head), so no names are needed. Bytes: 2(N-1)/N·S with N = 2, i.e. S per rank.

Pipes. An activation goes from virtual stage s to s+1, i.e. from rank s mod p to rank (s+1) mod p
of `mesh.pp` (`mesh.pp_next`, wrapping from the last rank to the first between chunks); its
gradient comes back the other way. The shapes are known ahead (`activation_shape`), so the
receiver allocates the buffer and no shape handshake is needed. Messages carry a tag made of the
micro-batch, the receiving chunk and the direction, so a receive never matches the wrong send.
Per step each rank sends m·A bytes for every virtual stage it holds that is not the last
(activations), and m·A for every one that is not the first (gradients), A the activation bytes:
    sent = m·A·(2v - [rank is first] - [rank is last])     (+ the tied all-reduce)
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn as nn

from minizero.comm import Mesh


class PipelineError(ValueError):
    """A model or batch that does not fit the pipeline: the message says which sizes."""


META_SIZE = 16  # int64s in a learned shape's metadata message: dtype id, ndim, up to 14 sizes
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]  # a pipe's dtypes, by id


class _Learned:
    """A receive posted before its buffer's shape is known: `post()` (receive the metadata if
    needed, allocate, receive) runs when it is waited for; the buffer is then `self.buffer`."""

    def __init__(self, post: Callable):
        self.post = post
        self.buffer = None

    def wait(self, sleep_s=None):
        self.buffer, work = self.post()
        if isinstance(work, _Learned):
            work.wait(sleep_s)
            self.buffer = work.buffer
        else:
            work.wait(sleep_s=sleep_s)


class PipelineModel(NamedTuple):
    """A model as a pipeline sees it. `loss_fn(outputs, targets)` -> the micro-batch's mean loss."""
    embed: nn.Module
    blocks: Sequence[nn.Module]
    head: nn.Module
    loss_fn: Callable
    hidden_shape: tuple | None = None  # one sample's hidden state between blocks, e.g. (T, n_embd)
    # (None: learned at the first step)
    stage_blocks: Sequence[range] | None = None  # each stage's blocks (DeepSpeed's cut); None: even


class StageChunk(nn.Module):
    """One virtual stage: [embed] + a run of blocks + [head]."""

    def __init__(self, index: int, embed: nn.Module | None, blocks: Sequence[nn.Module],
                 head: nn.Module | None, first_block: int):
        super().__init__()
        self.index = index                # virtual stage number, 0 .. S-1
        self.first_block = first_block    # global index of blocks[0] (names, traces)
        self.embed = embed                # only on virtual stage 0
        self.blocks = nn.ModuleList(blocks)
        self.head = head                  # only on the last virtual stage

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def partition(num_blocks: int, num_stages: int, num_chunks: int = 1) -> list[range]:
    """Block ranges of the S = p·v virtual stages: equal counts, the first ones one longer when
    they do not divide (v = 1 only: interleaving needs equal chunks)."""
    total = num_stages * num_chunks
    if total > num_blocks:
        raise PipelineError(f"{total} pipeline stages ({num_stages} ranks x {num_chunks} chunks) "
                            f"but the model has only {num_blocks} blocks: every stage needs at "
                            f"least one block; use at most {num_blocks} stages")
    if num_chunks > 1 and num_blocks % total:
        raise PipelineError(f"interleaving {num_chunks} chunks on {num_stages} ranks cuts the "
                            f"model into {total} equal chunks, but {num_blocks} blocks do not "
                            f"divide by {total}: use a number of blocks divisible by p*v, or "
                            "another num_chunks")
    size, extra = divmod(num_blocks, total)
    bounds = [0]
    for s in range(total):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


class PipelineStage(nn.Module):
    """This rank's chunks of `model`, and its pipes to the neighbouring ranks of `mesh.pp`.

    stage = PipelineStage(model, mesh, activation_shape=(micro_batch, T, n_embd))
    `stage.chunks[c]` is virtual stage c·p + mesh.pp_rank. Every rank must build `model` the
    same way (same seed): each keeps only its own chunks."""

    def __init__(self, model: PipelineModel, mesh: Mesh, activation_shape: Sequence[int] | None,
                 num_chunks: int = 1, dtype: torch.dtype = torch.float32):
        super().__init__()
        p, rank = mesh.pp_size, mesh.pp_rank
        given = getattr(model, "stage_blocks", None)
        ranges = (list(given) if given is not None and num_chunks == 1 and len(given) == p
                  else partition(len(model.blocks), p, num_chunks))
        self.mesh = mesh                            # the grid; this stage talks over mesh.pp only
        self.comm = mesh.pp  # the pipeline group: sends, receives, the tied group
        self.num_stages = p                         # ranks in the pipeline
        self.num_chunks = num_chunks                # model chunks per rank (v)
        self.num_virtual_stages = p * num_chunks    # S: the model is cut into this many pieces
        self.rank = rank  # this rank's place in the pipeline (mesh.pp_rank)
        self.loss_fn = model.loss_fn                # used by the chunk that holds the head
        # one micro-batch's hidden state: what a pipe carries; None: learned at the first step
        # (below)
        self.activation_shape = None if activation_shape is None else tuple(activation_shape)
        self.dtype = dtype                          # of what a pipe carries (the receive buffers)
        self.in_meta = {}                           # learned: chunk -> (shape, dtype) it receives
        self.out_meta = {}                          # learned: chunk -> (shape, dtype) it sends on
        self.device = mesh.world.device             # where the receive buffers live
        # the neighbours along the pipe, as ranks of mesh.pp (wrapping only matters when v > 1)
        self.next_rank = mesh.pp_next if mesh.pp_next is not None else 0
        self.prev_rank = mesh.pp_prev if mesh.pp_prev is not None else p - 1
        last = self.num_virtual_stages - 1
        chunks = []
        for c in range(num_chunks):
            s = c * p + rank
            blocks = [model.blocks[i] for i in ranges[s]]
            chunks.append(StageChunk(s, model.embed if s == 0 else None, blocks,
                                     model.head if s == last else None, ranges[s].start))
        self.chunks = nn.ModuleList(chunks)         # chunk c is virtual stage c*p + rank
        # global block indices
        self.block_ranges = [ranges[c * p + rank] for c in range(num_chunks)]
        # this rank's copies of tied weights, their group
        self.tied, self.tie_comm = self._tie(model, mesh)

    # ------------------------------------------------------------------ tied weights
    def _tie(self, model, mesh):
        """Parameters shared by embed and head; when those sit on different ranks, the 2-rank group
        {first, last} of mesh.pp that keeps their gradients summed (every pp rank calls
        new_group)."""
        head_ids = {id(q) for q in model.head.parameters()}
        shared = [q for q in model.embed.parameters() if id(q) in head_ids and q.requires_grad]
        if not shared or self.num_stages == 1:
            return [], None  # one rank holds both uses: autograd adds the two gradients already
        group = mesh.pp.new_group([0, self.num_stages - 1], name=f"tied/{mesh.pp.name}")
        mine = {id(q) for q in self.parameters()}
        return [q for q in shared if id(q) in mine], group

    @torch.no_grad()
    def reduce_tied_gradients(self):
        """Sum the tied parameters' gradients over the first and last stage (Megatron's
        embedding all-reduce). A no-op on the ranks in between."""
        if self.tie_comm is None:
            return
        for q in self.tied:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            self.tie_comm.all_reduce(q.grad, op="sum")

    @torch.no_grad()
    def reduce_tied_shards(self, owned, dp_comm, tie_comm=None):
        """The same sum when ZeRO-2/3 has already reduced the gradients into dp shards and freed the
        full ones (reduce_tied_gradients would find nothing to sum). owned: per tied parameter q,
        (q, lo, view): the reduced gradient of q's flattened elements [lo, lo + view.numel()) that
        this rank holds. The two stages' shards cover different ranges of q, so q's reduced gradient
        is rebuilt first (each element is held by exactly one dp rank: an all-reduce over dp), then
        summed over the tied pair, and each rank keeps its range. Bytes per rank: 2(N-1)/N·S over dp
        plus S over the pair (S the tied tensor's bytes): 2(N-1)/N·S more than reduce_tied_gradients
        sends."""
        tie_comm = tie_comm or self.tie_comm
        if tie_comm is None:
            return
        for q, lo, view in owned:
            full = torch.zeros(q.full_shape.numel() if hasattr(q, "full_shape") else q.numel(),
                               dtype=view.dtype, device=view.device)
            full[lo:lo + view.numel()] = view
            dp_comm.all_reduce(full, op="sum")
            tie_comm.all_reduce(full, op="sum")
            view.copy_(full[lo:lo + view.numel()])

    # ------------------------------------------------------------------ the pipes
    def tag(self, microbatch: int, chunk: int, gradient: bool) -> int:
        """Message tag: which micro-batch, for which chunk of the receiver, which direction."""
        return 2 * (microbatch * self.num_chunks + chunk) + int(gradient)

    def is_first(self, chunk: int) -> bool:
        return chunk * self.num_stages + self.rank == 0

    def is_last(self, chunk: int) -> bool:
        return chunk * self.num_stages + self.rank == self.num_virtual_stages - 1

    # Learned shapes (activation_shape None), as DeepSpeed's PipelineEngine does
    # (runtime/pipe/engine.py: _send_tensor_meta before its first send of outputs, _recv_tensor_meta
    # on its first receive): the first send through each pipe is preceded by one metadata message,
    # [dtype id, ndim, *shape] in META_SIZE int64s (DeepSpeed: 256 int32s, and a tuple's tensors one
    # after another), with the same tag as the activation it describes, so it arrives first
    # (messages between two ranks with one tag keep their order). The receiver allocates from it; a
    # gradient has its output's shape, which the sender knows already. Shapes are then fixed, as
    # DeepSpeed's without dynamic_shape: a later micro-batch of another shape is an error.
    def recv_activation(self, microbatch: int, chunk: int) -> tuple[torch.Tensor | None, object]:
        """Post the receive of chunk `chunk`'s input from the previous virtual stage: (buffer,
        work). Before the shape is known: (None, work) and work.buffer, allocated once its metadata
        came, after work.wait()."""
        tag = self.tag(microbatch, chunk, False)
        meta = ((self.activation_shape, self.dtype) if self.activation_shape is not None
                else self.in_meta.get(chunk))
        if meta is None:
            return None, _Learned(lambda: self._post_learned_recv(chunk, tag))
        buf = torch.empty(meta[0], dtype=meta[1], device=self.device)
        return buf, self.comm.irecv(buf, self.prev_rank, tag=tag)

    def _post_learned_recv(self, chunk, tag):
        if chunk not in self.in_meta:
            meta = torch.zeros(META_SIZE, dtype=torch.int64, device=self.device)
            self.comm.irecv(meta, self.prev_rank, tag=tag).wait()
            dtype, ndim = _DTYPES[int(meta[0])], int(meta[1])
            self.in_meta[chunk] = (tuple(int(n) for n in meta[2:2 + ndim]), dtype)
        shape, dtype = self.in_meta[chunk]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return buf, self.comm.irecv(buf, self.prev_rank, tag=tag)

    def send_activation(self, out: torch.Tensor, microbatch: int, chunk: int):
        """Send chunk `chunk`'s output to the next virtual stage (async: returns the work)."""
        receiver_chunk = chunk + (self.rank == self.num_stages - 1)
        tag = self.tag(microbatch, receiver_chunk, False)
        if self.activation_shape is None:
            stage = chunk * self.num_stages + self.rank
            tensor = isinstance(out, torch.Tensor)
            if not tensor or out.dtype not in _DTYPES or out.dim() > META_SIZE - 2:
                what = out.dtype if tensor else type(out).__name__
                raise PipelineError(f"virtual stage {stage} returned {what}: a pipe carries one "
                                    f"floating-point tensor of at most {META_SIZE - 2} dimensions")
            learned = (tuple(out.shape), out.dtype)
            if chunk not in self.out_meta:
                self.out_meta[chunk] = learned
                meta = torch.zeros(META_SIZE, dtype=torch.int64, device=out.device)
                meta[:2 + out.dim()] = torch.tensor([_DTYPES.index(out.dtype), out.dim(),
                                                     *out.shape])
                self.comm.isend(meta, self.next_rank, tag=tag).wait()
            elif self.out_meta[chunk] != learned:
                raise PipelineError(f"virtual stage {stage} returned {learned} at micro-batch "
                                    f"{microbatch}, but {self.out_meta[chunk]} at the first: "
                                    "the shapes between stages are learned once (DeepSpeed's "
                                    "dynamic_shape is not implemented); keep every micro-batch "
                                    "the same shape")
        return self.comm.isend(out, self.next_rank, tag=tag)

    def recv_gradient(self, microbatch: int, chunk: int) -> tuple[torch.Tensor | None, object]:
        """Post the receive of the gradient of chunk `chunk`'s output from the next virtual
        stage."""
        tag = self.tag(microbatch, chunk, True)
        meta = ((self.activation_shape, self.dtype) if self.activation_shape is not None
                else self.out_meta.get(chunk))
        if meta is None:  # the output is not sent yet: allocate when waited for (F has run by then)
            return None, _Learned(lambda: self.recv_gradient(microbatch, chunk))
        buf = torch.empty(meta[0], dtype=meta[1], device=self.device)
        return buf, self.comm.irecv(buf, self.next_rank, tag=tag)

    def send_gradient(self, grad: torch.Tensor, microbatch: int, chunk: int):
        """Send the gradient of chunk `chunk`'s input back to the previous virtual stage."""
        receiver_chunk = chunk - (self.rank == 0)
        return self.comm.isend(grad, self.prev_rank, tag=self.tag(microbatch, receiver_chunk, True))

    @property
    def activation_nbytes(self) -> int:
        """A: the bytes of one micro-batch's message through a pipe (activation or its gradient);
        with learned shapes, what this rank sends on (0 before the first step)."""
        shape, dtype = ((self.activation_shape, self.dtype) if self.activation_shape is not None
                        else next(iter(self.out_meta.values()), ((0,), self.dtype)))
        return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()

    def p2p_bytes_per_step(self, num_microbatches: int) -> int:
        """What this rank should send per step through the pipes (module docstring)."""
        sends = sum(2 - self.is_first(c) - self.is_last(c) for c in range(self.num_chunks))
        return num_microbatches * self.activation_nbytes * sends

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineStage is run by PipelineRuntime.step(inputs, targets), not "
                           "called: its chunks need inputs from other ranks")

    def extra_repr(self) -> str:
        return (f"rank {self.rank} of {self.num_stages}, virtual stages "
                f"{[c.index for c in self.chunks]} of {self.num_virtual_stages}, blocks "
                f"{[(r.start, r.stop) for r in self.block_ranges]}, tied {len(self.tied)}")
