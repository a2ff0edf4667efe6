"""The planner: what one rank holds and sends for a model shape, a batch, a world and a strategy.

    shape = ModelShape(layers=24, hidden=2048, heads=16, seq=1024, vocab=50257)
    p = plan(shape, ParallelStrategy(world=16, node_size=8, tp=2, pp=2, zero=1, micro_batch=4,
                                     micro_batches=8))
    p.stages[0].memory["activations"], p.stages[0].sent_by_link["cross-node"]

Everything is a formula of minizero's own layouts, so a run of the same configuration can check it
(tests/test_planner_validation.py compares it with the ledger and comm.stats):

* The grid is the Mesh's, arange(world).view(dp, pp, cp, tp), tp fastest; "node" = node_size
  consecutive ranks. A group whose ranks all sit on one node talks over the intra-node link, any
  other over the cross-node one (a ring is as fast as its slowest link). Ranks of one pipeline stage
  hold and send the same, so the plan has one entry per stage.
* Parameters per rank: TinyGPT's tensors (block = 12h² + 13h; wte V·h, wpe s·h, ln_f 2h, lm_head V·h
  unless tied). PP: blocks cut uniformly, the first stages one longer (pipeline.partition); the
  embeddings on the first stage, ln_f and lm_head on the last. TP (Megatron): the four matrices and
  the column biases split by t (12h² + 7h), row biases and LayerNorms whole (6h); wte and lm_head
  split over the vocabulary.
* Model states over the DP group: memory.estimate_by_location (ZeRO stages, offload), at the peak
  (after backward): stage 0 holds its gradients twice there (DDP's buckets and autograd's .grad,
  until the step makes .grad views into the buckets; torch's DDP without gradient_as_bucket_view
  does the same). Padding (at most dp-1 elements per flat buffer) is not counted.
* Activations: memory.activation_bytes (Korthikanti et al. 2022, no dropout: minizero's models have
  none) per layer held, times the micro-batches in flight (no PP: 1; GPipe: m; 1F1B: min(p - stage,
  m)), plus the head on the last stage: the LN and LM-head inputs and the log-softmax, w·s·b·(2h +
  V/t) (with SP the two inputs are sequence shards: 2h/t).
* Bytes sent per step (comm.stats' ring model, f = (N-1)/N of the group): DP stage 0 all-reduce
  2f·Ψ·b_g (with gradient clipping, ZeRO 1-2 add one float's all-reduce); stage 1 reduce-scatter +
  all-gather f·Ψ(b_g + b_p); stage 2 reduce every micro-batch
  m·f·Ψ·b_g + all-gather f·Ψ·b_p; stage 3 (every unit gathered in forward and again in backward,
  reduce-scattered, per micro-batch) 3·m·f·Ψ·b_c. TP: the tensor package's own count
  (tensor.parallel_gpt.collectives_per_step): 4 all-reduces of s·b·h per layer per micro-batch (2
  forward g, 2 backward f; SP: reduce-scatter/all-gather pairs, 2 re-gathers in backward and the
  replicated gradients' all-reduces), the embedding's g, lm_head's f, the loss's 3 scalars per
  token; checkpointing repeats each layer's forward collectives but the last (torch's early stop:
  measured). (For pp > 1 the embedding's share goes to the first stage, the head's and the loss's to
  the last.) PP: m·A per pipe (activations forward unless last, gradients back unless first), A =
  w·s·b·h, and the tied embedding's all-reduce between the first and last stage (V·h·4/t).
  ZeRO++ (zero 3 only): zero.zeropp.bytes_per_rank on the units padded to the world, per
  micro-batch, by link: the ring collectives ("dp"), inside a node ("dp-node": hpZ's gather, qgZ's
  first hop), to other nodes ("dp-across": qgZ's second hop); hpZ holds 1/k of every gathered unit
  more.
* CP (context parallelism, the Mesh's grid dp x pp x cp x tp): each rank holds s/cp tokens, so every
  activation term (and the pipeline's messages) is the formula at s/cp; parameters are replicated
  over cp and reduced over dp x cp (Megatron's layout), so ZeRO shards over dp·cp. The "cp" group
  sends the mechanism's own bytes per attention layer and micro-batch (context.ring_bytes_per_layer:
  (cp-1) K/V blocks forward, (2cp-1) backward, of 2·b·(s/cp)·h·w each; with `ulysses`
  context.ulysses_bytes_per_layer: 8 all-to-alls of (cp-1)/cp·b·(s/cp)·h·w); checkpointing repeats
  the forward.
* Sparse attention (attention_density < 1, DeepSpeed's sparse_attention): the score term a·s²
  becomes the layout's kept elements, density·a·s² (density = sparse.score_bytes(layout, 1, block,
  1, causal) / (a·s²)), plus the output the block-sparse backward keeps (w·b·s·h per layer). Not
  counted: its kept-block indices (3 int64 per kept block); dense attention's causal mask (s² bytes)
  is not counted either.
* 1-bit Adam (optimizer "onebitadam": zero 0, fp32, dp only): the "dp" group sends the gradients'
  fp32 all-reduce during the warm-up (freeze_step steps), then the momentum's compressed all-reduce,
  one flat buffer: 2(N-1)/N·(n/8 + 4N) for n padded to 8N (compression.bytes_compressed); sent["dp"]
  is the mean over a run of `steps` (the warm-up's without one), StagePlan.onebit has both phases
  and the run's reduction. Memory adds its error buffers: worker n padded, server n/N, fp32
  ("compression_errors"). Stage 0 holds one gradient copy after backward, as every stage-0 run
  (DDP's .grad are views of its buckets by then).
* EP (MoE shapes: `experts` > 0, every block's MLP becomes E experts of the same size, tp = 1 as
  minizero's MoELayer): each rank holds E/ep experts per layer, reduced over dp·cp/ep ("expert_dp");
  the "ep" group sends 4 all-to-alls per MoE layer and micro-batch (6 with checkpointing) of
  moe.all_to_all_bytes(E, C, h, w, ep) = (ep-1)/ep·E·C·h·w, C = moe.capacity(b·s/cp, E, k, cf).
  The expert MLP's two 4h-wide saved tensors cover E·C slots instead of b·s/cp tokens (not validated
  against a run). tests/test_planner.py checks the cp and ep bytes against the formulas that
  tests/test_context.py and tests/test_moe.py measure with comm.stats.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minizero import memory
from minizero.zero.zeropp import bytes_per_rank

DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}
STATE_BYTES = {"adam": 8, "sgd": 4, "onebitadam": 8}   # per element: Adam's m and v; SGD's momentum
SCHEDULES = ("gpipe", "1f1b")
FREEZE_STEP = 100000  # DeepSpeed's OneBitAdam default freeze_step


class PlanError(ValueError):
    """A layout that cannot run, said with the sizes and what to change."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int              # sequence length (TinyGPT's block_size: wpe has this many rows)
    vocab: int
    tied: bool = False    # lm_head.weight IS wte.weight
    experts: int = 0  # MoE: experts per block (0 = dense): each MLP becomes E MLPs + a router h·E
    top_k: int = 1        # MoE: experts each token is routed to (1 or 2)
    capacity_factor: float = 1.25  # MoE: slots per expert C = ceil(k·T·cf / E)
    # sparse attention: kept score elements per head over s² (sparse.density)
    attention_density: float = 1.0

    def mlp_params(self) -> int:  # one MLP (h -> 4h -> h) = one expert
        return 8 * self.hidden ** 2 + 5 * self.hidden

    def block_params(self) -> int:
        dense = 12 * self.hidden ** 2 + 13 * self.hidden
        return (
            dense + (self.experts - 1) * self.mlp_params() + self.hidden * self.experts
            if self.experts
            else dense
        )

    def active_params(self) -> int:  # what one token computes with: k experts of E (FLOPs)
        return self.num_params() - self.layers * (self.experts - self.top_k) * self.mlp_params() * (
            self.experts > 0
        )

    def num_params(self) -> int:
        h, v = self.hidden, self.vocab
        return (
            self.layers * self.block_params()
            + v * h * (1 if self.tied else 2)
            + self.seq * h
            + 2 * h
        )

    @classmethod
    def from_params(
        cls, num_params: float, hidden=None, seq=1024, vocab=50257, heads=None
    ) -> "ModelShape":
        """A GPT of about `num_params` parameters: hidden from the count (GPT-3's width ladder)
        unless given, layers = what fills the rest, heads = hidden / 128."""
        if hidden is None:
            hidden = next((w for w,
                           top in ((768, 2e8), (1024, 5e8), (2048, 2e9), (4096, 1e10), (8192, 1e11))
                           if num_params <= top), 12288)
        rest = num_params - 2 * vocab * hidden - seq * hidden
        layers = max(1, round(rest / (12 * hidden ** 2 + 13 * hidden)))
        return cls(layers, hidden, heads or max(1, hidden // 128), seq, vocab)


@dataclass(frozen=True)
class ParallelStrategy:
    world: int
    node_size: int = 8            # ranks per node: groups inside one are "intra-node"
    tp: int = 1                   # tensor-parallel size (Megatron), inside a node
    pp: int = 1                   # pipeline stages
    sp: bool = False              # sequence parallelism with TP
    zero: int = 0                 # ZeRO stage over the DP group (0 = DDP)
    offload: bool = False  # ZeRO-Offload: masters, fp32 grads and optimizer state on the host
    micro_batch: int = 1          # sequences per rank per micro-batch
    micro_batches: int = 1        # gradient accumulation steps = pipeline micro-batches m
    schedule: str = "1f1b"
    checkpointing: bool = False   # activation checkpointing per block
    precision: str = "bf16"       # fp32, fp16 or bf16 (16 bits: fp32 masters)
    optimizer: str = "adam"
    qwz: bool = False             # ZeRO++ quantized weights: int8 all-gathers (zero 3)
    hpz: bool = False  # ZeRO++ secondary partition: backward gathers inside a node (zero 3)
    qgz: bool = False  # ZeRO++ quantized gradients: int4 hierarchical all-to-all (zero 3)
    cp: int = 1                   # context-parallel size: each rank holds s/cp of the sequence
    ulysses: bool = False         # cp by DeepSpeed-Ulysses' all-to-alls instead of ring attention
    ep: int = 1                   # expert-parallel size (MoE shapes): E/ep experts per rank
    freeze_step: int = FREEZE_STEP  # optimizer "onebitadam": warm-up steps of plain Adam
    steps: int = 0  # optimizer "onebitadam": the run's length (0: no run, per-step figures only)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"pp{self.pp}" if self.pp > 1 else "",
                 f"tp{self.tp}" if self.tp > 1 else "", "sp" if self.sp else "",
                 (f"cp{self.cp}" + ("u" if self.ulysses else "")) if self.cp > 1 else "",
                 f"ep{self.ep}" if self.ep > 1 else "", f"zero{self.zero}",
                 "offload" if self.offload else "", "ckpt" if self.checkpointing else "",
                 "qwz" if self.qwz else "", "hpz" if self.hpz else "", "qgz" if self.qgz else ""]
        return "-".join(p for p in parts if p)

    @property
    def zeropp(self) -> bool:
        return self.qwz or self.hpz or self.qgz


@dataclass
class StagePlan:
    stage: int
    params: int                                     # parameter elements on each rank of this stage
    memory: dict = field(default_factory=dict)      # category -> bytes on the device
    host: dict = field(default_factory=dict)        # category -> bytes on the host (offload)
    transient: dict = field(default_factory=dict)   # largest short-lived buffers -> bytes
    sent: dict = field(default_factory=dict)        # group (dp, tp, pp, tied) -> bytes per step
    # 1-bit Adam's dp bytes: per step by phase, over the run
    onebit: dict = field(default_factory=dict)
    link: dict = field(default_factory=dict)        # group -> "intra-node" | "cross-node"

    @property
    def device_total(self) -> float:
        return sum(self.memory.values()) + max(self.transient.values(), default=0)

    @property
    def sent_by_link(self) -> dict:
        out = {"intra-node": 0.0, "cross-node": 0.0}
        for group, nbytes in self.sent.items():
            out[self.link[group]] += nbytes
        return out


@dataclass
class Plan:
    shape: ModelShape
    strategy: ParallelStrategy
    stages: list

    @property
    def peak_device_bytes(self) -> float:
        return max(s.device_total for s in self.stages)

    def as_dict(self) -> dict:
        return {"shape": asdict(self.shape),
                "strategy": {**asdict(self.strategy), "dp": self.strategy.dp},
                "name": self.strategy.name(), "num_params": self.shape.num_params(),
                "peak_device_bytes": self.peak_device_bytes,
                "stages": [{**asdict(s), "device_total": s.device_total,
                            "sent_by_link": s.sent_by_link}
                           for s in self.stages]}


def check(shape: ModelShape, s: ParallelStrategy) -> None:
    """Every reason this layout cannot run, as one PlanError naming the sizes."""
    for name, value in (("world", s.world), ("node_size", s.node_size), ("tp", s.tp), ("pp", s.pp),
                        ("micro_batch", s.micro_batch), ("micro_batches", s.micro_batches),
                        ("cp", s.cp), ("ep", s.ep)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive whole number, got {value!r}")
    if s.world % (s.tp * s.pp * s.cp):
        cp = f" x cp {s.cp}" if s.cp > 1 else ""
        raise PlanError(f"tp {s.tp} x pp {s.pp}{cp} = {s.tp * s.pp * s.cp} does not divide the "
                        f"world size {s.world}: dp x pp{cp and ' x cp'} x tp must equal the number "
                        "of ranks")
    if s.tp > s.node_size or s.node_size % s.tp:
        raise PlanError(f"tp {s.tp} does not fit in a node of {s.node_size} ranks: tensor "
                        "parallelism talks every layer, keep it inside a node (tp <= node size, "
                        "dividing it)")
    if shape.heads % s.tp:
        raise PlanError(f"{shape.heads} attention heads do not divide by tp {s.tp}: each rank owns "
                        "whole heads")
    if shape.vocab % s.tp:
        raise PlanError(f"vocabulary {shape.vocab} does not divide by tp {s.tp} (vocab-parallel "
                        "embedding)")
    if s.zero not in (0, 1, 2, 3):
        raise PlanError(f"zero stage must be 0, 1, 2 or 3, got {s.zero!r}")
    if s.pp > 1 and s.zero >= 2:
        raise PlanError(f"ZeRO stage {s.zero} with pipeline parallelism: gradients (and "
                        "parameters) sharded across the micro-batches would be re-reduced every "
                        "micro-batch; use zero 0 or 1 with pp > 1")
    if s.pp > shape.layers:
        raise PlanError(f"{s.pp} pipeline stages but only {shape.layers} layers: at most one stage "
                        "per layer")
    wrong = memory.offload_stage_error(s.zero, "cpu" if s.offload else "none")
    if wrong:
        raise PlanError(wrong.replace("offload_optimizer.device='cpu'", "offload"))
    if s.sp and s.tp == 1:
        raise PlanError("sequence parallelism needs tp > 1")
    if s.zeropp and (s.zero != 3 or s.tp > 1 or s.pp > 1 or s.offload):
        raise PlanError("ZeRO++ (qwz, hpz, qgz) is ZeRO stage 3 over every rank: zero 3, tp 1, pp "
                        f"1, no offload (as minizero's ZeroPP and DeepSpeed); got zero {s.zero}, "
                        f"tp {s.tp}, pp {s.pp}, offload {s.offload}")
    if s.zeropp and s.world % s.node_size:
        raise PlanError(f"ZeRO++ groups ranks by node: node_size {s.node_size} must divide the "
                        f"world {s.world}")
    if shape.seq % (2 * s.cp if s.cp > 1 and not s.ulysses else s.cp):
        raise PlanError(f"sequence {shape.seq} does not divide by "
                        f"{'2 x ' if not s.ulysses else ''}cp {s.cp}: "
                        + ("Ulysses gives each rank s/cp tokens" if s.ulysses else
                           "balanced ring attention gives each rank two chunks of s/(2cp) tokens"))
    if s.ulysses and (s.cp == 1 or (shape.heads // s.tp) % s.cp):
        raise PlanError("Ulysses needs cp > 1 dividing the heads per rank "
                        f"({shape.heads // s.tp}); got cp {s.cp}")
    if shape.experts < 0 or shape.top_k not in (1, 2) or not shape.capacity_factor > 0:
        raise PlanError(f"experts >= 0, top_k 1 or 2, capacity_factor > 0; got {shape.experts}, "
                        f"{shape.top_k}, {shape.capacity_factor}")
    if s.ep > 1 and (not shape.experts or shape.experts % s.ep or s.dp % s.ep):
        raise PlanError(f"ep {s.ep} needs a MoE shape whose experts ({shape.experts}) and dp "
                        f"({s.dp}) divide by it: each rank of an ep slice of the dp group holds "
                        "experts / ep experts")
    if shape.experts and s.tp > 1:
        raise PlanError("a MoE shape with tp > 1 is not planned: minizero's MoELayer keeps each "
                        "expert whole")
    if s.zeropp and (s.cp > 1 or s.ep > 1):
        raise PlanError("ZeRO++ (qwz, hpz, qgz) is planned without cp or ep")
    if not 0 < shape.attention_density <= 1:
        raise PlanError(f"attention_density is the kept fraction of the scores, in (0, 1]; got "
                        f"{shape.attention_density}")
    if shape.attention_density < 1 and s.cp > 1:
        raise PlanError("sparse attention (attention_density < 1) with cp > 1: not available (the "
                        "engine refuses sparse_attention with sequence_parallel_size > 1)")
    for name in ("freeze_step", "steps"):
        if not isinstance(getattr(s, name), int) or getattr(s, name) < 0:
            raise PlanError(f"{name} must be a whole number >= 0, got {getattr(s, name)!r}")
    if s.optimizer == "onebitadam" and (
        s.zero
        or s.precision != "fp32"
        or s.tp > 1
        or s.pp > 1
        or s.cp > 1
        or s.offload
        or shape.experts
    ):
        raise PlanError("1-bit Adam (onebitadam) runs at ZeRO stage 0, in fp32, over one "
                        "data-parallel group (as minizero's engine and DeepSpeed); got zero "
                        f"{s.zero}, precision {s.precision}, tp {s.tp}, pp {s.pp}, cp {s.cp}, "
                        f"offload {s.offload}, experts {shape.experts}")
    if s.schedule not in SCHEDULES or s.precision not in DTYPES or s.optimizer not in STATE_BYTES:
        raise PlanError(f"schedule in {SCHEDULES}, precision in {tuple(DTYPES)}, optimizer in "
                        f"{tuple(STATE_BYTES)}; got {s.schedule!r}, {s.precision!r}, "
                        f"{s.optimizer!r}")


def _link(ranks: list, node_size: int) -> str:
    return "intra-node" if len({r // node_size for r in ranks}) == 1 else "cross-node"


def plan(shape: ModelShape, s: ParallelStrategy) -> Plan:
    check(shape, s)
    h, v, t, w = shape.hidden, shape.vocab, s.tp, DTYPES[s.precision]
    # tokens: this rank's
    b, sq, m, tokens = s.micro_batch, shape.seq, s.micro_batches, shape.seq // s.cp
    dp = s.dp * s.cp  # the gradient group: dp x cp (Megatron)
    sizes, extra = divmod(shape.layers, s.pp)
    stages = []
    for stage in range(s.pp):
        layers = sizes + (stage < extra)
        first, last = stage == 0, stage == s.pp - 1
        # expert elements on this rank
        experts = layers * shape.experts // s.ep * shape.mlp_params()
        block = (shape.block_params() - shape.experts * shape.mlp_params() if shape.experts
                 else (12 * h * h + 7 * h) // t + 6 * h)
        params = layers * block + experts
        params += (v * h // t + sq * h) if first else 0
        params += (2 * h + (0 if shape.tied and first else v * h // t)) if last else 0
        sp = StagePlan(stage, params)
        # minizero's ZeRO-3 keeps fp32 shards and shard gradients on the device; offloaded, the
        # 16-bit shard
        # experts over dp·cp/ep
        parts = [(params - experts, dp)] + ([(experts, dp // s.ep)] if experts else [])
        for elements, group in parts:
            states = memory.estimate_by_location(elements, group, s.zero,
                                                 param_bytes=4 if s.zero == 3 and not s.offload
                                                 else w, grad_bytes=4 if s.zero == 3 else w,
                                                 state_bytes=STATE_BYTES[s.optimizer],
                                                 offload_optimizer="cpu" if s.offload else "none")
            for category, where in states.items():
                sp.memory[category] = sp.memory.get(category, 0) + where["device"]
                sp.host[category] = sp.host.get(category, 0) + where["host"]
        # stage 0 holds one gradient copy after backward: the engine's DDP averages at the end of
        # each backward (as DeepSpeed's allreduce_gradients) and each .grad becomes a view of its
        # bucket; during backward both exist for the parameters not yet finished, a transient not
        # counted here (as ZeRO's buckets are not)
        # the worker error (the padded flat buffer) and the server's 1/N
        if s.optimizer == "onebitadam" and dp > 1:
            from minizero.compression import padded_numel
            sp.memory["compression_errors"] = 4 * padded_numel(params, dp) * (1 + 1 / dp)
        in_flight = 1 if s.pp == 1 else m if s.schedule == "gpipe" else min(s.pp - stage, m)
        acts = memory.activation_bytes(
            b,
            tokens,
            h,
            layers,
            shape.heads,
            bytes_per=w,
            checkpointing=s.checkpointing,
            tensor_parallel=t,
            sequence_parallel=s.sp,
            dropout=False,
            attention_scores=shape.attention_density * shape.heads * tokens**2,
        )
        # block-sparse backward keeps its [b, a, s, d] output
        if shape.attention_density < 1 and not s.checkpointing:
            acts += layers * w * b * tokens * h / t  # besides the projection's (contiguous) input
        # the expert MLP's GeLU and 2nd-linear inputs: E·C slots, not b·s/cp
        if shape.experts and not s.checkpointing:
            acts += layers * 8 * w * h * (shape.experts * _capacity(shape, s) - b * tokens)
        # SP: ln_f, lm_head see s/t
        head = w * tokens * b * (2 * h / (t if s.sp else 1) + v / t) if last else 0
        sp.memory["activations"] = in_flight * acts + head
        if s.zeropp:  # hpZ: each rank keeps 1/k of every unit, gathered, for its node-mates
            k = s.node_size if s.hpz and s.node_size > 1 else 0
            sp.memory["parameters"] += sum(_zeropp_units(shape, s)) // k * w if k else 0
        unit = (12 * h * h + 13 * h) * w  # one block's parameters, gathered (ZeRO-3) or bucketed
        sp.transient = (
            {"zero3 gathered units (this + prefetched)": 2 * unit / t} if s.zero == 3 else {}
        )
        if s.pp > 1:
            sp.transient["pipeline receive buffer"] = w * tokens * b * h
        _comm(sp, s, params - experts, experts, stage, first, last, layers, shape)
        stages.append(sp)
    return Plan(shape, s, stages)


def _capacity(shape: ModelShape, s: ParallelStrategy) -> int:
    from minizero.moe import capacity
    return capacity(s.micro_batch * shape.seq // s.cp, shape.experts, shape.top_k,
                    shape.capacity_factor)


def _dp_bytes(s: ParallelStrategy, params, group) -> float:
    f, w, m = (group - 1) / group, DTYPES[s.precision], s.micro_batches
    return {0: 2 * f * params * w, 1: f * params * 2 * w, 2: (m + 1) * f * params * w,
            3: 3 * m * f * params * w}[s.zero]


def _comm(sp: StagePlan, s: ParallelStrategy, params, experts, stage, first, last, layers, shape):
    """Bytes this stage's ranks send per optimizer step, by group, and each group's link class."""
    from minizero.context import ring_bytes_per_layer, ulysses_bytes_per_layer
    from minizero.moe import all_to_all_bytes
    w = DTYPES[s.precision]
    m, act = s.micro_batches, w * shape.seq // s.cp * s.micro_batch * shape.hidden
    def at(d, p, c, k):  # the Mesh's grid[d, p, c, t], computed (not built: O(world) per stage)
        return ((d * s.pp + p) * s.cp + c) * s.tp + k
    dp_ranks = [at(d, stage, c, 0) for d in range(s.dp) for c in range(s.cp)]
    if s.dp * s.cp > 1 and s.zeropp:  # zero.zeropp.bytes_per_rank: the mechanism's own formula
        sent = bytes_per_rank(_zeropp_units(shape, s), s.world, s.node_size, w, s.qwz, s.hpz, s.qgz)
        for group, link_name, link in (("dp", "ring", _link(dp_ranks, s.node_size)),
                                       ("dp-node", "node", "intra-node"),
                                       ("dp-across", "across", "cross-node")):
            nbytes = m * sum(b[link_name] for b in sent.values())
            if nbytes:
                sp.sent[group], sp.link[group] = nbytes, link
    elif s.dp * s.cp > 1:
        sp.sent["dp"], sp.link["dp"] = (
            _dp_bytes(s, params, s.dp * s.cp),
            _link(dp_ranks, s.node_size),
        )
        if s.optimizer == "onebitadam":
            sp.onebit = _onebit_bytes(s, params, sp.sent["dp"])
            sp.sent["dp"] = (
                sp.onebit["run_bytes"] / s.steps if s.steps else sp.onebit["warmup_step"]
            )
    # the ranks holding the same experts: d % ep equal, every c
    if experts and s.dp * s.cp // s.ep > 1:
        sp.sent["expert_dp"] = _dp_bytes(s, experts, s.dp * s.cp // s.ep)
        sp.link["expert_dp"] = _link(
            [at(d, stage, c, 0) for d in range(0, s.dp, s.ep) for c in range(s.cp)], s.node_size
        )
    if s.tp > 1:
        sp.sent["tp"], sp.link["tp"] = (
            _tp_bytes(s, shape, layers, first, last),
            _link([at(0, stage, 0, k) for k in range(s.tp)], s.node_size),
        )
    if s.cp > 1:  # the mechanism's bytes per attention layer; the recompute repeats the forward
        ring = (ulysses_bytes_per_layer if s.ulysses else ring_bytes_per_layer)(
            s.micro_batch, shape.seq, shape.hidden // s.tp, s.cp, w)
        sp.sent["cp"] = m * layers * (ring["forward"] * (1 + s.checkpointing) + ring["backward"])
        sp.link["cp"] = _link([at(0, stage, c, 0) for c in range(s.cp)], s.node_size)
    if s.ep > 1:  # dispatch + combine, forward and backward (+ the recomputed forward's two)
        one = all_to_all_bytes(shape.experts, _capacity(shape, s), shape.hidden, w, s.ep)
        sp.sent["ep"] = m * layers * (4 + 2 * s.checkpointing) * one
        sp.link["ep"] = _link([at(d, stage, 0, 0) for d in range(s.ep)], s.node_size)
    if s.pp > 1:
        sp.sent["pp"] = m * act * ((not last) + (not first))
        sp.link["pp"] = _link([at(0, p, 0, 0) for p in range(s.pp)], s.node_size)
        if shape.tied and (first or last):
            sp.sent["tied"] = shape.vocab * shape.hidden * 4 / s.tp
            sp.link["tied"] = _link([at(0, 0, 0, 0), at(0, s.pp - 1, 0, 0)], s.node_size)


def _onebit_bytes(s: ParallelStrategy, params, warmup_step) -> dict:
    """1-bit Adam's data-parallel bytes (compression/onebit_adam.py, one flat buffer as
    OneBitAdamStrategy): the warm-up's fp32 all-reduce of the gradients, then the momentum's
    compressed all-reduce (1 bit per padded element and a 4-byte scale per chunk, twice); over a run
    of `steps` with min(freeze_step, steps) warm-up steps."""
    from minizero.compression import bytes_compressed, end_to_end_reduction
    compressed = bytes_compressed(params, s.dp)
    warm = min(s.freeze_step, s.steps)
    out = {"warmup_step": warmup_step, "compressed_step": compressed,
           "step_reduction": warmup_step / compressed}
    if s.steps:
        out.update(steps=s.steps, warmup_steps=warm,
                   run_bytes=warm * warmup_step + (s.steps - warm) * compressed,
                   adam_run_bytes=s.steps * warmup_step,
                   run_reduction=end_to_end_reduction(s.steps, s.freeze_step, warmup_step,
                                                      compressed))
    return out


def _zeropp_units(shape: ModelShape, s: ParallelStrategy) -> list:
    """ZeRO-3's units (FSDP: one per block, the root holds the rest), each padded to a multiple of
    the world: the elements each all-gather carries."""
    block = 12 * shape.hidden ** 2 + 13 * shape.hidden
    root = shape.num_params() - shape.layers * block
    return [-(-u // s.world) * s.world for u in [root] + [block] * shape.layers]


def _tp_bytes(s: ParallelStrategy, shape: ModelShape, layers, first, last) -> float:
    """The tp group's bytes per step, from the tensor package's own count of its collectives
    (tensor.parallel_gpt.collectives_per_step, ring model as comm.stats): per layer and pass, plus
    the embedding (first stage) and the LM head and loss (last stage). Checkpointing repeats each
    layer's forward collectives in the recompute."""
    from minizero.comm.stats import ring_bytes_sent
    from minizero.tensor.parallel_gpt import collectives_per_step
    w, t = DTYPES[s.precision], s.tp
    count = collectives_per_step(layers, s.micro_batch, shape.seq // s.cp, shape.hidden, shape.seq,
                                 t, s.sp, bytes_per=w)

    def sent(ops):
        return sum(ring_bytes_sent(op, payload, t) for op, (_, payload) in ops.items())
    forward, backward = sent(count["per_layer"]["forward"]), sent(count["per_layer"]["backward"])
    extras = sent(count["forward"]) + sent(count["backward"]) - layers * (forward + backward)
    act = w * shape.seq // s.cp * s.micro_batch * shape.hidden
    # g (SP: reduce-scatter, and its all-gather back)
    embedding = ring_bytes_sent("all_reduce", act, t)
    if s.sp:  # wpe's gradient, seen by s/t tokens per rank, is all-reduced
        embedding += ring_bytes_sent("all_reduce", shape.seq * shape.hidden * w, t)
    ends = (
        extras if s.pp == 1 else (embedding if first else 0) + (extras - embedding if last else 0)
    )
    # the recompute repeats a layer's forward collectives but the last (the block output's g:
    # torch's early stop ends the recompute once every
    # saved tensor is back, and nothing saved needs it)
    last_g = ring_bytes_sent("reduce_scatter" if s.sp else "all_reduce", act, t)
    per_micro = (
        layers * (forward + backward)
        + (layers * (forward - last_g) if s.checkpointing else 0)
        + ends
    )
    return s.micro_batches * per_micro
