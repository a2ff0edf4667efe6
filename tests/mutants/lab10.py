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
        #   The gradient of a sum is the same on every rank: return it as it is,
        #   and None for comm.
        return grad, None'''
ROW_FORWARD = '''            y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y'''
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
    Mutant("the column layer uses g where f belongs", "F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)",
           "F.linear(reduce_from_tensor_parallel(x, self.comm), self.weight, self.bias)",
           "check_mlp", "ColumnParallelLinear forward: 1 all_reduce, expected no collective: f is the identity"),
    Mutant("the row layer uses f where g belongs", "reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "copy_to_tensor_parallel(F.linear(x, self.weight), self.comm)",
           "check_mlp", "RowParallelLinear forward: no collective, expected 1 all_reduce"),
    Mutant("the row-parallel bias is added on every rank, before the sum", ROW_FORWARD,
           ROW_FORWARD.replace("F.linear(x, self.weight)", "F.linear(x, self.weight, self.bias)")
           .replace("return y + self.bias if self.bias is not None else y", "return y"),
           "check_mlp", "added on every rank before the sum"),
    Mutant("the row layer splits the weight along the wrong dim", "shard(weight, 1, self.comm.rank",
           "shard(weight, 0, self.comm.rank", "check_slices", "columns (input features, dim 1)"),
    Mutant("wrong slice offsets (rank instead of rank * width)", "block.narrow(dim, rank * width, width)",
           "block.narrow(dim, rank, width)", "check_slices", "wrong slice offsets"),
    Mutant("the fused q|k|v layer is cut as one block", "blocks = full.chunk(chunks, dim)", "blocks = [full]",
           "check_slices", "slice of EACH block"),
]
