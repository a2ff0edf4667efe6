"""minizero.tensor: Megatron-style tensor parallelism, and sequence parallelism.

    layers.py        f and g (autograd functions), ColumnParallelLinear, RowParallelLinear (lab 10)
    sequence.py      sequence parallelism: all-gather / reduce-scatter along the sequence, the
                     column layer that re-gathers its input shard in backward, SP gradient hooks
    vocab.py         VocabParallelEmbedding, vocab_parallel_cross_entropy (never gathers logits)
    blocks.py        parallelize_block: attention with the heads split, MLP column-then-row
    parallel_gpt.py  TensorParallelGPT: a whole nanoGPT-named model, converted in place;
                     collectives_per_step, the count a test measures
Activation memory with TP and SP: memory.activation_bytes (Korthikanti's formula) against
memory.SavedTensors (what autograd really keeps).

Every layer takes the tensor-parallel Communicator explicitly (mesh.tp): no globals, so a TP
block works inside a pipeline stage or next to a data-parallel wrapper over mesh.dp.
"""
from minizero.tensor.blocks import parallelize_attention, parallelize_block, parallelize_mlp
from minizero.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_parallel, gather_from_tensor_parallel,
                                    reduce_from_tensor_parallel, shard, unshard)
from minizero.tensor.parallel_gpt import TensorParallelGPT, gather_full
from minizero.tensor.sequence import mark_sequence_parallel
from minizero.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelGPT",
           "VocabParallelEmbedding", "copy_to_tensor_parallel", "gather_from_tensor_parallel",
           "gather_full", "mark_sequence_parallel", "parallelize_attention", "parallelize_block",
           "parallelize_mlp", "reduce_from_tensor_parallel", "shard", "unshard",
           "vocab_parallel_cross_entropy"]
