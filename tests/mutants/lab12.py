"""Lab 12's mutants: plausible student bugs in the MoE slots, the all-to-all, dispatch, the exchanges and
combine (solutions/lab12_moe_dispatch.py).
tests/test_mutants.py grades them with every lab's, sharing one launch per check worker."""
from tests.mutants import Mutant

CHOICE_MAJOR = '''    choice_major = one_hot.transpose(0, 1).reshape(k * tokens, num_experts)
    slots = ((choice_major.cumsum(0) - 1) * choice_major).sum(-1)      # [k*T]
    positions = slots.view(k, tokens).t()'''
A2A_FORWARD = '''        out = torch.empty_like(x)
        comm.all_to_all(out, x.contiguous())
        return out'''
A2A_BACKWARD = '''        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad.contiguous())
        return out, None'''
DISPATCH_SLOTS = '''    slot = (expert_index * capacity + positions)[kept]
    token = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1).expand(-1, k)[kept]'''
COMBINE = "return (picked * (gates * kept).unsqueeze(-1)).sum(1)"

MUTANTS = [
    Mutant("slots start at 1 (the running count without - 1)", "((choice_major.cumsum(0) - 1) * choice_major)",
           "(choice_major.cumsum(0) * choice_major)", "check_positions", "slots start at 1"),
    Mutant("choices laid out token-major: a token's second choice before the next token's first",
           CHOICE_MAJOR,
           CHOICE_MAJOR.replace("one_hot.transpose(0, 1).reshape(k * tokens", "one_hot.reshape(tokens * k")
           .replace("slots.view(k, tokens).t()", "slots.view(tokens, k)"),
           "check_positions", "before any second choice"),
    Mutant("kept = slot <= capacity (keeps slot C)", "return positions, positions < capacity",
           "return positions, positions <= capacity", "check_positions", "the slots are 0..C-1"),
    Mutant("AllToAll's forward returns its input", A2A_FORWARD, "        return x",
           "check_alltoall", "expected 1 all_to_all: block j of the input goes to rank j"),
    Mutant("AllToAll's backward returns the gradient without sending it back", A2A_BACKWARD,
           "        return grad, None",
           "check_alltoall", "the gradient was not sent back"),
    Mutant("dispatch writes the dropped choices too", DISPATCH_SLOTS,
           DISPATCH_SLOTS.replace("positions)[kept]", "positions).reshape(-1)").replace("(-1, k)[kept]",
                                                                                        "(-1, k).reshape(-1)"),
           "check_local", "DROPPED"),
    Mutant("dispatch's slot index forgets the expert's offset e * C",
           "slot = (expert_index * capacity + positions)[kept]",
           "slot = (expert_index + positions)[kept]", "check_local", "slot (e, c) holds the token whose kept choice"),
    Mutant("combine sums the experts' outputs without the gates", COMBINE,
           "return (picked * kept.unsqueeze(-1)).sum(1)",
           "check_local", "not weighted by the gates"),
    Mutant("combine lets a dropped choice count (gates not masked by kept)", COMBINE,
           "return (picked * gates.unsqueeze(-1)).sum(1)", "check_local", "a dropped choice contributed"),
    Mutant("exchange_to_experts merges dims without putting the local expert first",
           "received.transpose(0, 1).reshape(", "received.reshape(", "check_exchange",
           "the local expert must come first"),
    Mutant("exchange_from_experts sends blocks without putting the source rank first",
           "hidden).transpose(0, 1).contiguous()", "hidden).contiguous()", "check_exchange",
           "must undo exchange_to_experts"),
    Mutant("combine detaches the gates (no gradient reaches the router)", COMBINE,
           "return (picked * (gates.detach() * kept).unsqueeze(-1)).sum(1)", "check_layer",
           "the router learns only through the gates"),
]

# dispatch in the tokens' dtype (float64 and bfloat16 tokens)
BUFFER = "    buffer = tokens.new_zeros(num_experts * capacity, tokens.shape[1])\n"
MUTANTS += [
    Mutant("dispatch's buffer made with the default dtype (index_add then refuses other dtypes)", BUFFER,
           "    buffer = torch.zeros(num_experts * capacity, tokens.shape[1], device=tokens.device)\n",
           "check_local", "the buffer must be made in the tokens' dtype"),
    Mutant("dispatch casts the tokens to float32 to fit a default-dtype buffer",
           BUFFER + "    return buffer.index_add(0, slot, tokens[token])",
           "    buffer = torch.zeros(num_experts * capacity, tokens.shape[1], device=tokens.device)\n"
           "    return buffer.index_add(0, slot, tokens[token].float())", "check_local", "returned float32"),
]

# AllToAll and combine keep a bf16 model's dtype too
MUTANTS += [
    Mutant("AllToAll's forward sends float32 (the output made with the default dtype, the input "
           "cast to fit)", A2A_FORWARD, "        out = torch.empty(x.shape, device=x.device)\n"
           "        comm.all_to_all(out, x.float().contiguous())\n        return out",
           "check_alltoall", "returned float32"),
    Mutant("AllToAll's backward sends the gradient as float32", A2A_BACKWARD,
           "        out = torch.empty(grad.shape, device=grad.device)\n"
           "        ctx.comm.all_to_all(out, grad.float().contiguous())\n        return out, None",
           "check_alltoall", "the gradient in its own dtype"),
    Mutant("combine multiplies by kept.float() (a bf16 output comes back float32)", COMBINE,
           "return (picked * (gates * kept.float()).unsqueeze(-1)).sum(1)", "check_local",
           "combine of bfloat16"),
]

# the slots with a Python loop over the tokens (the docstring forbids it: T is 1e4-1e5 per rank)
LOOP = '''    tokens, k = expert_index.shape
    filled = torch.zeros(num_experts, dtype=torch.long)
    positions = torch.zeros_like(expert_index)
    for j in range(k):
        for t in range(tokens):
            e = expert_index[t, j]
            positions[t, j] = filled[e]
            filled[e] += 1
    return positions, positions < capacity'''
LOOP_LIST = '''    tokens, k = expert_index.shape
    filled, choices = [0] * num_experts, expert_index.tolist()
    slots = [[0] * k for _ in range(tokens)]
    for j in range(k):
        for t in range(tokens):
            slots[t][j] = filled[choices[t][j]]
            filled[choices[t][j]] += 1
    positions = torch.tensor(slots, dtype=torch.long).view(tokens, k)
    return positions, positions < capacity'''
POSITIONS = '''    one_hot = F.one_hot(expert_index, num_experts)                     # [T, k, E]
    tokens, k = expert_index.shape
''' + CHOICE_MAJOR + "\n    return positions, positions < capacity"
MUTANTS += [
    Mutant("expert_positions fills the slots in a Python loop over the tokens (tensor indexing)",
           POSITIONS, LOOP, "check_positions", "a Python loop over the tokens"),
    Mutant("expert_positions fills the slots in a Python loop over a list of the choices",
           POSITIONS, LOOP_LIST, "check_positions", "a Python loop over the tokens"),
]
