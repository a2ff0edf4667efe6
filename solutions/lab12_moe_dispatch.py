# Lab 12: MoE dispatch and combine with all-to-all
# GENERATED from minizero/moe/dispatch.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab12_moe_dispatch.py
#   check: python -m minizero_course grade --lab 12 --impl solutions    (or: pytest -m lab12 --impl solutions)
"""MoE dispatch and combine: tokens to their experts' slots, across ranks by all-to-all, and back.

GShard (Lepikhin et al. 2020, Algorithm 1) and DeepSpeed-MoE (Rajbhandari et al. 2022):
E experts are shared out over the ep ranks of an expert-parallel group, E/ep on each. Every rank
routes its own T tokens (router.py) and then

  1. positions: slot c of expert e for each of its T*k choices; first choices fill slots before
     second choices (token order inside each), and a choice whose slot is >= C is dropped;
  2. dispatch: a [E, C, d] buffer, slot (e, c) = the token sent there (zeros where no token came);
  3. all-to-all: [E, C, d] = [ep, E/ep, C, d]; block j (the experts of rank j) goes to rank j,
     so rank r receives [ep, E/ep, C, d]: every rank's tokens for r's own experts. Laid out as
     [E/ep, ep*C, d], each local expert runs once on all the tokens it got;
  4. the all-to-all back (the same exchange, reversed), then
  5. combine: y_t = sum_j g_tj * expert_{e_tj}(x_t) over the kept choices.

The buffers are fixed-size (C slots whatever arrives), so the all-to-all is an equal-chunk one and
its bytes do not depend on the routing. Per MoE layer, per rank, with b bytes per element:

    payload S = E * C * d * b           (the dispatched buffer)
    sent      = (ep - 1)/ep * S         per all-to-all (a rank keeps its own block)
    per step  = 4 * (ep - 1)/ep * E * C * d * b     (dispatch + combine, forward and backward)

The backward of an all-to-all is the all-to-all of the gradient: block j of the output came from
rank j, so its gradient goes back to rank j.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def all_to_all_bytes(
    num_experts: int, capacity: int, hidden: int, bytes_per: int, ep: int
) -> float:
    """Bytes one rank sends in ONE all-to-all of a [E, C, d] buffer over ep ranks: (ep-1)/ep *
    E*C*d*b."""
    return (ep - 1) / ep * num_experts * capacity * hidden * bytes_per


def expert_positions(expert_index: torch.Tensor, num_experts: int, capacity: int):
    """(positions [T, k], kept [T, k]): each choice's slot in its expert, first choices before
    second."""
    # the slot of every choice in its expert, and which are kept.
    #   What must hold: an expert's slots 0, 1, 2, ... go to its choices in priority order, every
    #   token's first choice before any token's second (GShard: a second choice never displaces
    #   a first), token order within each. So a choice's slot is the number of higher-priority
    #   choices that picked the same expert; slots >= capacity are dropped (the buffer has C rows
    #   per expert). [T, k] in, [T, k] out, no Python loop over tokens (T is 1e4-1e5 per rank).
    one_hot = F.one_hot(expert_index, num_experts)                     # [T, k, E]
    tokens, k = expert_index.shape
    choice_major = one_hot.transpose(0, 1).reshape(k * tokens, num_experts)
    slots = ((choice_major.cumsum(0) - 1) * choice_major).sum(-1)      # [k*T]
    positions = slots.view(k, tokens).t()
    return positions, positions < capacity


class AllToAll(torch.autograd.Function):
    """Block j of the input to rank j, block j of the output from rank j; backward: the same for the
    gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        # the forward exchange.
        #   What must hold: dim 0 of x is ep equal blocks; block j goes to rank j, and block j of the
        #   result is what rank j sent here, with x's shape and dtype. One collective,
        #   comm.all_to_all(output, input) on contiguous tensors: (ep-1)/ep of x's bytes leave.
        out = torch.empty_like(x)
        comm.all_to_all(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        # the backward exchange.
        #   What must hold: block j of the forward's output came from rank j, so the gradient of
        #   that block belongs to rank j. Which exchange takes it there? One gradient per forward
        #   input (x, comm).
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad.contiguous())
        return out, None


def all_to_all(x: torch.Tensor, comm) -> torch.Tensor:
    """AllToAll.apply; no exchange without a group (ep = 1)."""
    return x if comm is None or comm.size == 1 else AllToAll.apply(x, comm)


def dispatch(
    tokens: torch.Tensor, expert_index, positions, kept, num_experts: int, capacity: int
) -> torch.Tensor:
    """[E, C, d]: slot (e, c) holds the token whose choice landed there; zeros elsewhere."""
    # scatter the kept choices into their slots.
    #   What must hold: the result is [E, C, d] in the tokens' dtype and device (a bf16 model
    #   sends bf16: the all-to-all's bytes are E C d b); slot (e, c) holds the token whose KEPT
    #   choice got slot c of expert e, zeros where none did; a dropped choice writes nothing
    #   (its e*C + c would land in the next expert's rows). The tokens need their gradient: build
    #   the buffer with an out-of-place op autograd follows, no in-place write into a leaf.
    k = expert_index.shape[1]
    slot = (expert_index * capacity + positions)[kept]
    token = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1).expand(-1, k)[kept]
    buffer = tokens.new_zeros(num_experts * capacity, tokens.shape[1])
    return buffer.index_add(0, slot, tokens[token]).view(num_experts, capacity, -1)


def exchange_to_experts(dispatched: torch.Tensor, comm) -> torch.Tensor:
    """[E, C, d] on every rank -> [E/ep, ep*C, d]: this rank's experts, each with every rank's
    slots."""
    ep = 1 if comm is None else comm.size
    experts, cap, hidden = dispatched.shape
    # send each rank its experts' slots; regroup what arrives by local expert.
    #   What must hold: rank r owns experts r E/ep .. (r+1) E/ep - 1, a contiguous block of dim 0.
    #   Afterwards row block [i, j C : (j+1) C] is rank j's C slots of this rank's local expert i,
    #   so each expert runs ONCE on [ep C, d]. Shapes: [E, C, d] in, [E/ep, ep C, d] out; think
    #   about the order of the dims of what arrives. Bytes: one all-to-all, (ep-1)/ep E C d b sent.
    received = all_to_all(dispatched, comm).view(ep, experts // ep, cap, hidden)
    return received.transpose(0, 1).reshape(experts // ep, ep * cap, hidden)


def exchange_from_experts(expert_out: torch.Tensor, comm) -> torch.Tensor:
    """The inverse: [E/ep, ep*C, d] expert outputs -> [E, C, d], this rank's own slots of every
    expert."""
    ep = 1 if comm is None else comm.size
    local, rows, hidden = expert_out.shape
    # undo exchange_to_experts.
    #   What must hold: exchange_from_experts(exchange_to_experts(x)) == x on every rank: slot
    #   (e, c) comes back to the rank that dispatched it. The all-to-all sends dim 0's blocks, so
    #   what leaves must be ordered by destination rank. [E/ep, ep C, d] in, [E, C, d] out.
    blocks = expert_out.view(local, ep, rows // ep, hidden).transpose(0, 1).contiguous()
    return all_to_all(blocks, comm).view(local * ep, rows // ep, hidden)


def combine(expert_out: torch.Tensor, expert_index, positions, kept, gates) -> torch.Tensor:
    """[T, d]: y_t = sum_j gates[t, j] * expert_out[e_tj, c_tj] over the kept choices."""
    # gather each choice's output from its slot, weight it by its gate, sum the choices.
    #   What must hold: y_t = sum_j g_tj expert_out[e_tj, c_tj] over the kept choices only, [T, d].
    #   A dropped choice has no slot (c >= C: reading there reads another expert's row, or past
    #   the end) and contributes 0. The router learns only through the gates: keep them in the graph.
    experts, cap, hidden = expert_out.shape
    slot = torch.where(kept, expert_index * cap + positions, torch.zeros_like(positions))
    picked = expert_out.reshape(experts * cap, hidden)[slot]           # [T, k, d]
    return (picked * (gates * kept).unsqueeze(-1)).sum(1)


if __name__ == "__main__":
    from minizero_course.grader import lab_main
    lab_main(12, globals())
