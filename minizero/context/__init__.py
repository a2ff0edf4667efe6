"""minizero.context: context parallelism, the sequence split over the cp ranks of a Mesh.

    online_softmax.py  attention one key/value block at a time: block_attention -> (o_B, L_B), the
                       online-softmax merge of partial results, each block's gradients (lab 11)
    layout.py          which tokens a rank holds: contiguous shards, or two mirrored chunks per rank
                       (causal load balancing); the causal work per rank that follows
    ring_attention.py  ring attention (Liu et al. 2023; Megatron-LM's CP): K/V blocks travel the
                       ring, overlapped with the compute; custom backward; BlockWork counts the work
    ulysses.py         DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all sequence shards -> head
                       shards, local attention, and back
Everything outside attention (LayerNorm, MLP, projections) acts on each token alone and runs on the
rank's s/cp tokens as it is; its parameter gradients are partial sums over the tokens, reduced over
the cp group as over dp (Megatron reduces them over dp x cp).
Measured: minizero_course/experiments/context.py.

Every function takes the context-parallel Communicator explicitly (mesh.cp).
"""
from minizero.context.layout import chunks_of, scores_per_rank, shard_sequence, unshard_sequence
from minizero.context.online_softmax import block_attention, merge
from minizero.context.ring_attention import (BlockWork, attention_activation_bytes, ring_attention,
                                             ring_bytes_per_layer)
from minizero.context.ulysses import check_heads, ulysses_attention, ulysses_bytes_per_layer

__all__ = ["BlockWork", "attention_activation_bytes", "block_attention", "check_heads", "chunks_of",
           "merge", "ring_attention", "ring_bytes_per_layer", "scores_per_rank", "shard_sequence",
           "ulysses_attention", "ulysses_bytes_per_layer", "unshard_sequence"]
