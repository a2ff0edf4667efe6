# Lab 12: MoE dispatch and combine with all-to-all
# GENERATED from minizero/moe/dispatch.py by `make labs`. Edit nothing: this is the reference solution.
#   run:   mpirun -n 4 python solutions/lab12_moe_dispatch.py
#   check: python -m minizero grade --lab 12 --impl solutions    (or: pytest -m lab12 --impl solutions)
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


def all_to_all_bytes(num_experts: int, capacity: int, hidden: int, bytes_per: int, ep: int) -> float:
    """Bytes one rank sends in ONE all-to-all of a [E, C, d] buffer over ep ranks: (ep-1)/ep * E*C*d*b."""
    return (ep - 1) / ep * num_experts * capacity * hidden * bytes_per


def expert_positions(expert_index: torch.Tensor, num_experts: int, capacity: int):
    """(positions [T, k], kept [T, k]): each choice's slot in its expert, first choices before second."""
    # the slot of every choice in its expert, and which are kept.
    #   One-hot the choices, lay them out choice-major ([k*T, E]: all first choices, then all second);
    #   a running count per expert (cumsum) - 1 is the slot; kept = slot < capacity.
    one_hot = F.one_hot(expert_index, num_experts)                     # [T, k, E]
    tokens, k = expert_index.shape
    choice_major = one_hot.transpose(0, 1).reshape(k * tokens, num_experts)
    slots = ((choice_major.cumsum(0) - 1) * choice_major).sum(-1)      # [k*T]
    positions = slots.view(k, tokens).t()
    return positions, positions < capacity


class AllToAll(torch.autograd.Function):
    """Block j of the input to rank j, block j of the output from rank j; backward: the same for the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        # the forward exchange.
        #   An output buffer like x; comm.all_to_all(output, a contiguous x); return the output.
        out = torch.empty_like(x)
        comm.all_to_all(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        # the backward exchange.
        #   The gradient of block j came from rank j: send it back with the same all-to-all; None for comm.
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad.contiguous())
        return out, None


def all_to_all(x: torch.Tensor, comm) -> torch.Tensor:
    """AllToAll.apply; no exchange without a group (ep = 1)."""
    return x if comm is None or comm.size == 1 else AllToAll.apply(x, comm)


def dispatch(tokens: torch.Tensor, expert_index, positions, kept, num_experts: int, capacity: int) -> torch.Tensor:
    """[E, C, d]: slot (e, c) holds the token whose choice landed there; zeros elsewhere."""
    # scatter the kept choices into their slots.
    #   Slot index e * C + c of each kept choice; the token of each choice is its row;
    #   index_add (out of place, so autograd sees it) the tokens into a zero [E*C, d] buffer.
    k = expert_index.shape[1]
    slot = (expert_index * capacity + positions)[kept]
    token = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1).expand(-1, k)[kept]
    buffer = tokens.new_zeros(num_experts * capacity, tokens.shape[1])
    return buffer.index_add(0, slot, tokens[token]).view(num_experts, capacity, -1)


def exchange_to_experts(dispatched: torch.Tensor, comm) -> torch.Tensor:
    """[E, C, d] on every rank -> [E/ep, ep*C, d]: this rank's experts, each with every rank's slots."""
    ep = 1 if comm is None else comm.size
    experts, cap, hidden = dispatched.shape
    # send each rank its experts' slots; regroup what arrives by local expert.
    #   all_to_all the buffer (block j = experts of rank j); what arrives is [ep (source), E/ep, C, d]:
    #   put the local expert first (transpose), then merge source and slot into ep*C rows.
    received = all_to_all(dispatched, comm).view(ep, experts // ep, cap, hidden)
    return received.transpose(0, 1).reshape(experts // ep, ep * cap, hidden)


def exchange_from_experts(expert_out: torch.Tensor, comm) -> torch.Tensor:
    """The inverse: [E/ep, ep*C, d] expert outputs -> [E, C, d], this rank's own slots of every expert."""
    ep = 1 if comm is None else comm.size
    local, rows, hidden = expert_out.shape
    # undo exchange_to_experts.
    #   Split the rows back into [E/ep, ep, C, d], put the source rank first (transpose, contiguous),
    #   all_to_all it home, view as [E, C, d].
    blocks = expert_out.view(local, ep, rows // ep, hidden).transpose(0, 1).contiguous()
    return all_to_all(blocks, comm).view(local * ep, rows // ep, hidden)


def combine(expert_out: torch.Tensor, expert_index, positions, kept, gates) -> torch.Tensor:
    """[T, d]: y_t = sum_j gates[t, j] * expert_out[e_tj, c_tj] over the kept choices."""
    # gather each choice's output from its slot, weight it by its gate, sum the choices.
    #   A dropped choice has no slot: read any valid one (e.g. slot 0) and weight it by 0.
    experts, cap, hidden = expert_out.shape
    slot = torch.where(kept, expert_index * cap + positions, torch.zeros_like(positions))
    picked = expert_out.reshape(experts * cap, hidden)[slot]           # [T, k, d]
    return (picked * (gates * kept).unsqueeze(-1)).sum(1)


if __name__ == "__main__":
    from minizero.autograde import lab_main
    lab_main(12, globals())
