"""Lab 10's mutants: plausible student bugs in the f/g operators and the column/row-parallel layers
(solutions/lab10_tensor_parallel.py).
tests/test_mutants.py grades them with every lab's, sharing one launch per check worker."""
from tests.mutants import Mutant

F_ALL_REDUCE = '        ctx.comm.all_reduce(grad, op="sum")\n        return grad, None'
G_FORWARD = '''        out = x.contiguous().clone()
        comm.all_reduce(out, op="sum")
        return out'''
G_BACKWARD = '''

    @staticmethod
    def backward(ctx, grad):
        # g's backward.
        #   dZ/dY_i B_i is the identity for every i, and dL/dZ is already whole and the same on
        #   every rank: what does each rank's partial product get, and what must be sent?
        return grad, None'''
ROW_FORWARD = '''            y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        else:'''
HELPERS = '''def copy_to_tensor_parallel(x, comm):
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x, comm):
    return ReduceFromTensorParallel.apply(x, comm)'''
SWAPPED = HELPERS.replace("CopyToTensorParallel", "@").replace("ReduceFromTensorParallel", "CopyToTensorParallel") \
    .replace("@", "ReduceFromTensorParallel")

MUTANTS = [
    Mutant("f and g swapped (f all-reduces in forward, g in backward)", HELPERS, SWAPPED,
           "check_fg", "f and g swapped"),
    Mutant("f's backward returns the gradient without the all-reduce", F_ALL_REDUCE, "        return grad, None",
           "check_fg", "missing all-reduce in backward"),
    Mutant("f's backward averages instead of summing", F_ALL_REDUCE, F_ALL_REDUCE.replace('"sum"', '"avg"'),
           "check_fg", "op='sum', not 'avg'"),
    Mutant("g averages instead of summing", G_FORWARD, G_FORWARD.replace('"sum"', '"avg"'),
           "check_fg", "averaging instead of summing"),
    Mutant("g all-reduces in backward too", G_FORWARD + G_BACKWARD,
           (G_FORWARD + G_BACKWARD).replace("        out = x", "        ctx.comm = comm\n        out = x")
           .replace("        return grad, None", "        grad = grad.contiguous().clone()\n"
                    "        ctx.comm.all_reduce(grad, op=\"sum\")\n        return grad, None"),
           "check_fg", "g is the identity in backward"),
    Mutant("the column layer uses g where f belongs",
           "F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)",
           "F.linear(reduce_from_tensor_parallel(x, self.comm), self.weight, self.bias)",
           "check_mlp", "ColumnParallelLinear forward: 1 all_reduce, expected no collective: f is the identity"),
    Mutant("the row layer uses f where g belongs", "reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "copy_to_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "check_mlp", "RowParallelLinear forward: no collective, expected 1 all_reduce"),
    Mutant("the row-parallel bias is added on every rank, before the sum", ROW_FORWARD,
           ROW_FORWARD.replace("F.linear(x, self.weight)", "F.linear(x, self.weight, self.bias)")
           .replace("        else:", "            return y  # the bias is in already\n        else:"),
           "check_mlp", "added on every rank before the sum"),
    Mutant("wrong slice offsets (rank instead of rank * width)", "block.narrow(dim, rank * width, width)",
           "block.narrow(dim, rank, width)", "check_slices", "wrong slice offsets"),
    Mutant("the fused q|k|v layer is cut as one block", "blocks = full.chunk(chunks, dim)", "blocks = [full]",
           "check_slices", "slice of EACH block"),
    # bf16 through f and g: the wire carries the input's dtype
    Mutant("g reduces in float32 for precision (bf16 in, fp32 out: twice the bytes)", G_FORWARD,
           G_FORWARD.replace("out = x.contiguous().clone()", "out = x.contiguous().float()"),
           "check_fg", "doubles the bytes on the wire"),
    Mutant("f's backward reduces the gradient in float32", F_ALL_REDUCE,
           F_ALL_REDUCE.replace("        ctx.comm.all_reduce",
                                "        grad = grad.float()\n        ctx.comm.all_reduce"),
           "check_fg", "f's backward all-reduce carried"),
    # the group: f and g run on the tp group they are given, never the world
    Mutant("g all-reduces over the world group, not the tp group", G_FORWARD,
           G_FORWARD.replace('comm.all_reduce(out, op="sum")',
                             'import minizero.comm\n        minizero.comm.get().all_reduce(out, op="sum")'),
           "check_fg", "another group than the tp group"),
    Mutant("f's backward all-reduces over the world group", F_ALL_REDUCE,
           F_ALL_REDUCE.replace("ctx.comm.all_reduce", "__import__('minizero.comm').comm.get().all_reduce"),
           "check_fg", "f's backward ran 1 collective(s) on another group than the tp group"),
    Mutant("the row layer's g gets the world group (the layers at tp 2 on 4 ranks)",
           "reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "reduce_from_tensor_parallel(F.linear(x, self.weight), __import__('minizero.comm').comm.get())",
           "check_mlp", "on another group than their tp group"),

    # the stretch task, sequence parallelism (extra points): its own mutants, graded by check_sp alone
    Mutant("SP: the row layer all-reduces (g) instead of reduce-scattering along the sequence",
           "y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.comm)",
           "y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "check_sp", "the row layer gives back a sequence shard"),
    Mutant("SP: the column layer uses f on the shard instead of all-gathering the sequence",
           "y = linear_with_sequence_gather(x, self.weight, self.bias, self.comm)",
           "y = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)",
           "check_sp", "all-gather, f_bar"),
    Mutant("SP: the row layer reduce-scatters over the world group, not its tp group",
           "y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.comm)",
           "y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), "
           "__import__('minizero.comm').comm.get())",
           "check_sp", "on another group than their tp group"),
    Mutant("SP: the row layer adds its bias before the reduce-scatter (counted t times)",
           "y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.comm)",
           "y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight, self.bias), self.comm)",
           "check_sp", "a bias added before the reduction"),
]
