"""The models every lesson, lab and test trains: small enough for 2 CPU cores,
shaped like the real thing so the parallel wrappers meet the real problems.

- TinyGPT: a nanoGPT-style decoder. Module names follow nanoGPT (wte, wpe, h.{i},
  ln_f, lm_head) and Megatron (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj), so
  the tensor-parallel lesson can point at "the column-parallel layer" by name.
- MLP: the smallest thing with several layers, for the first DDP steps.
- EdgeCaseModel: no learning value at all; it exists to break sharding code
  (tied, frozen, unused and odd-sized parameters, plus a buffer).

Determinism is the contract here. Every test compares a parallel run with a
single-process run, so two processes that build a model with the same seed must
hold bitwise-identical weights, and building a model must not disturb anyone
else's random numbers. Hence: torch's layers are built inside fork_rng (their
default init draws from the global RNG, which is put back untouched afterwards),
then every parameter is overwritten from a local torch.Generator.
(Building on the "meta" device would skip the wasted default init, as FSDP does
for huge models, but its init ops import torch._dynamo: ~2 s in every rank.)
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64     # matches data.SyntheticTokens; ln(64) = 4.16 nats is the loss at init
    block_size: int = 32     # longest sequence; wpe has this many rows
    n_layer: int = 2         # two blocks: enough for pipeline stages and per-block ZeRO-3 gathers
    n_head: int = 4          # splits evenly over 1, 2 or 4 tensor-parallel ranks
    n_embd: int = 64         # must be divisible by n_head
    # True: lm_head.weight IS wte.weight (one Parameter used by two modules)
    tie_weights: bool = False
    bias: bool = True        # biases in Linear and LayerNorm; False like many modern LLMs
    # > 0: every block's MLP is a minizero.moe.MoE of this many experts (DeepSpeed-MoE's layer; the
    # engine shares them out over moe_ep_size ranks), top-k routing; the loss adds moe_aux_loss_coef
    # x l_aux per block
    num_experts: int = 0
    moe_ep_size: int = 1
    moe_top_k: int = 1
    moe_capacity_factor: float = 1.25
    moe_aux_loss_coef: float = 0.01
    # No dropout on purpose: tests compare runs bitwise, and dropout would need an RNG
    # stream per rank that matches the single-process one. Not worth it at this size.


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _private_rng():
    """Context for building layers: their default init may use the global RNG, then it is
    restored."""
    return torch.random.fork_rng(devices=[])


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.head_dim = config.n_embd // config.n_head
        # One fused Linear for q, k and v (one matmul instead of three), output laid
        # out as [q | k | v]. Megatron splits this layer by columns, c_proj by rows.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # the context-parallel group (TinyGPT.set_context_parallel): attention over it
        self.cp_comm = None
        self.cp_ring = False  # True: ring attention on two mirrored chunks per rank; False: Ulysses
        self.sparse_attention = None  # a minizero.sparse SparsityConfig: block-sparse attention
                                      # (apply_sparse_attention)

    def forward(self, x):
        qkv = self.c_attn(x)
        # The head count comes from the tensor width and B, T from c_attn's output,
        # not from the config or x: a column-parallel c_attn that returns [q | k | v]
        # for its own heads only, and a sequence-parallel one that receives s/t tokens
        # and all-gathers the sequence, then run through this code unchanged.
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        nh = q.size(-1) // self.head_dim
        q, k, v = (t.view(B, T, nh, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # T = this rank's two mirrored chunks of s/(2cp) tokens
        if self.cp_comm is not None and self.cp_ring:
            from minizero.context.ring_attention import ring_attention
            y = ring_attention(q, k, v, self.cp_comm, causal=True, balanced=True)
        # T = this rank's s/cp tokens: DeepSpeed-Ulysses over the cp group
        elif self.cp_comm is not None:
            from minizero.context.ulysses import ulysses_attention
            y = ulysses_attention(q, k, v, self.cp_comm, causal=True)
        # only the layout's blocks are computed (minizero/sparse)
        elif self.sparse_attention is not None:
            from minizero.sparse import sparse_self_attention
            y = sparse_self_attention(q, k, v, self.sparse_attention)
        else:
            y = self.core_attention(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, nh * self.head_dim)
        return self.c_proj(y)

    def core_attention(self, q, k, v):
        """softmax(q·kᵀ/√d, causal)·v on (B, heads, T, d). Its own method so that selective
        activation recomputation (activation_checkpointing, granularity "selective") can recompute
        just this part: the a·s² scores and softmax, Korthikanti's 5as/h term. Written out (not
        F.scaled_dot_product_attention) so students see every step, and so there is no backend
        choice that could change the bits."""
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return att.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)).
    Pre-LN keeps the residual stream an identity path, so it trains without warmup."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.num_experts:
            from minizero.moe import MoE
            self.mlp = MoE(config.n_embd, 4 * config.n_embd, config.num_experts, config.moe_ep_size,
                           config.moe_top_k, config.moe_capacity_factor, config.moe_capacity_factor,
                           min_capacity=1)
        else:
            self.mlp = GPTMLP(config)
        self.aux_loss = None  # the MoE's l_aux of this forward (None: a dense MLP)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        if isinstance(self.mlp, GPTMLP):
            return x + self.mlp(self.ln_2(x))
        out, self.aux_loss, _ = self.mlp(self.ln_2(x))
        return x + out


def token_loss(logits, targets):
    """Mean cross-entropy over all B*T tokens, or None without targets. DDP averages per-rank
    means, which equals this only because every rank holds the same number of tokens
    (data.shard)."""
    if targets is None:
        return None
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig = None, seed: int = 0):
        super().__init__()
        self.config = config = config or GPTConfig()
        with _private_rng():
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter in two modules: the output projection scores token v by
            # its dot product with v's input embedding. Saves vocab*n_embd parameters.
            self.lm_head.weight = self.wte.weight
        # the context-parallel group: forward keeps this rank's s/cp tokens (set_context_parallel)
        self.cp_comm = None
        # which of them: contiguous (Ulysses) or two mirrored chunks (ring attention)
        self.cp_ring = False
        self.reset_parameters(seed)

    def set_context_parallel(self, comm, attention: str = "ulysses"):
        """The engine's hook (sequence_parallel_size): from now on forward takes whole sequences,
        keeps this rank's s/cp tokens of them (their positions), and every attention runs over
        `comm`: "ulysses" (DeepSpeed-Ulysses on contiguous shards) or "ring" (ring attention on
        chunks r and 2cp-1-r, causal load balancing; context/layout.py). Logits and loss are this
        rank's tokens' (in that order); the engine averages over dp x cp."""
        if attention not in ("ulysses", "ring"):
            raise ValueError(f"set_context_parallel: attention {attention!r} is not 'ulysses' or "
                             "'ring'")
        if any(block.attn.sparse_attention is not None for block in self.h):
            raise ValueError("sparse_attention does not compose with context parallelism "
                             "(sequence_parallel_size > 1): use one or the other")
        if attention == "ulysses":
            from minizero.context.ulysses import check_heads
            check_heads(self.config.n_head, comm.size)
        self.cp_comm, self.cp_ring = comm, attention == "ring"
        for block in self.h:
            block.attn.cp_comm, block.attn.cp_ring = comm, self.cp_ring

    def _context_slice(self, idx, targets):
        """(idx, targets, positions) of this rank's tokens (context/layout.py's shard_sequence)."""
        from minizero.context.layout import check_sequence, shard_sequence
        cp, rank, T = self.cp_comm.size, self.cp_comm.rank, idx.shape[1]
        try:
            check_sequence(T, cp, self.cp_ring)
        except ValueError as e:
            raise ValueError(f"sequence_parallel_size {cp}: {e}") from None
        mine = lambda t: shard_sequence(t, rank, cp, self.cp_ring, dim=t.dim() - 1)  # noqa: E731
        positions = mine(torch.arange(T, device=idx.device))
        return mine(idx), None if targets is None else mine(targets), positions

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        """GPT-2 init, drawn from a generator seeded by `seed` alone.

        named_parameters() yields a tied weight once and in a fixed order, so the
        draws are the same in every process."""
        g = _generator(seed)
        # Residual projections are scaled by 1/sqrt(2 n_layer) (GPT-2 paper, sec. 2.3):
        # each block adds two of them to the residual stream, and this keeps its
        # variance from growing with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.split(".")[-2].startswith("ln_"):  # ln_1, ln_2, ln_f: start as identity
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith((".bias", "experts.b1", "experts.b2")):
                p.zero_()
            # an expert's second layer is its c_proj
            elif name.endswith(("c_proj.weight", "experts.w2")):
                p.normal_(0.0, residual_std, generator=g)
            else:  # wte, wpe, lm_head, c_attn, c_fc
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        positions = None
        if self.cp_comm is not None:
            idx, targets, positions = self._context_slice(idx, targets)
        # the code the pipeline's first and last stage run (pipeline_parts)
        x = GPTEmbed.forward(self, idx, positions)
        for block in self.h:
            x = block(x)
        logits = GPTHead.forward(self, x)
        loss = token_loss(logits, targets)
        # DeepSpeed-MoE: the user adds the weighted l_aux
        if loss is not None and self.config.num_experts:
            loss = loss + self.config.moe_aux_loss_coef * sum(block.aux_loss for block in self.h)
        return logits, loss

    def num_params(self) -> int:
        """Parameters counted once each (a tied weight is one tensor in memory)."""
        return sum(p.numel() for p in self.parameters())

    def pipeline_parts(self):
        """This model as minizero.pipeline sees it: embed (wte + wpe), the blocks, head (ln_f +
        lm_head) and the loss. The same modules, not copies: a tied lm_head stays the very Parameter
        of wte, which is how the pipeline finds the pair it must keep in sync across stages."""
        from minizero.pipeline import PipelineModel
        return PipelineModel(GPTEmbed(self.wte, self.wpe), list(self.h),
                             GPTHead(self.ln_f, self.lm_head), token_loss,
                             (self.config.block_size, self.config.n_embd))


class GPTEmbed(nn.Module):
    """TinyGPT's input side, as a pipeline's first stage: token + position embeddings."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte = wte
        self.wpe = wpe

    def forward(self, idx, positions=None):
        """positions: of idx's tokens (a context-parallel rank's: TinyGPT._context_slice); None: 0
        .. T-1."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class GPTHead(nn.Module):
    """TinyGPT's output side, as a pipeline's last stage: final LayerNorm and the LM head."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_f = ln_f
        self.lm_head = lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class MLP(nn.Module):
    """Linear -> GELU -> ... -> Linear, with an MSE loss (data.regression_batch)."""

    def __init__(self, sizes=(16, 32, 32, 4), seed: int = 0):
        super().__init__()
        self.sizes = tuple(sizes)
        with _private_rng():
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        g = _generator(seed)
        for layer in self.layers:
            # LeCun-style normal init (std 1/sqrt(fan_in)): keeps activations O(1)
            # through the GELUs so the loss starts at a sensible value.
            layer.weight.normal_(0.0, 1.0 / math.sqrt(layer.in_features), generator=g)
            layer.bias.zero_()

    def forward(self, x, y=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        loss = F.mse_loss(x, y) if y is not None else None
        return x, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class EdgeCaseModel(nn.Module):
    """Every parameter situation a sharded wrapper gets wrong at least once.

        emb      11x5 = 55   tied: head.weight IS emb.weight (two modules, one Parameter)
        frozen   5x5 + 5     requires_grad=False but used: no grad, yet must be gathered
        fc1      5->13       65 + 13 elements: sizes not divisible by 2, 3 or 4
        fc2      13->5       65 + 5
        unused   2x3         never touched in forward: its grad stays None
        scale    buffer (5,) used in forward, saved in state_dict, never trained

    Totals are chosen so flat padding is always needed: 209 trainable elements
    (11*19), 239 in all (prime), neither divisible by 2, 3 or 4.
    Input: token ids in [0, 11), sequences of length 6 (any length works).
    """

    vocab_size = 11
    block_size = 6

    def __init__(self, seed: int = 0):
        super().__init__()
        d, hidden = 5, 13
        with _private_rng():
            self.emb = nn.Embedding(self.vocab_size, d)
            self.frozen = nn.Linear(d, d)
            self.fc1 = nn.Linear(d, hidden)
            self.fc2 = nn.Linear(hidden, d)
            self.head = nn.Linear(d, self.vocab_size, bias=False)
        self.unused = nn.Parameter(torch.empty(2, 3))
        self.register_buffer("scale", torch.empty(d))
        self.head.weight = self.emb.weight
        self.frozen.requires_grad_(False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        g = _generator(seed)
        # Larger than GPT's 0.02 so that every parameter visibly moves the loss: a
        # wrapper that drops one of them fails the comparison instead of hiding in
        # rounding noise.
        for _, p in self.named_parameters():
            p.normal_(0.0, 0.5, generator=g)
        self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        h = h + self.frozen(h)
        h = h * self.scale
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return logits, token_loss(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


MODELS = {
    "tiny-gpt": lambda seed=0, **cfg: TinyGPT(GPTConfig(**cfg), seed=seed),
    # every block's MLP a mixture of 4 experts, top-2,
    # shared out over 2 ranks (DeepSpeed-MoE's ep_size)
    "tiny-gpt-moe": lambda seed=0,
    **cfg: TinyGPT(GPTConfig(**{"num_experts": 4, "moe_ep_size": 2, "moe_top_k": 2,
                                                              **cfg}), seed=seed),
    "mlp": MLP,
    "edge": EdgeCaseModel,
}


def build_model(name: str, **overrides) -> nn.Module:
    """build_model("tiny-gpt", n_layer=4, seed=1): GPTConfig fields and `seed` as keywords.
    "mlp" takes sizes= and seed=; "edge" takes seed=."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](**overrides)
