"""What a raw failure most likely means, said in the lab's words.

A check that crashes hands the student a raw message: an MPI error stack, a torch shape error, a
KeyError from deep inside a wrapper. Each common signature below maps to the mistake that
usually causes it. The grader prints the raw message first and the hint under it ("likely
cause: ..."), so the hint never hides what really happened.
"""
from __future__ import annotations

import re

# (regex searched in the failure text, the likely cause). First match wins: specific before generic.
HINTS = [
    (r"not implemented yet", None),  # an untouched stub says what to do itself
    (r"ranks disagree on shapes/dtypes",
     "the ranks issued different collectives at the same point. Every rank must issue the same "
     "collectives, with the same sizes, in the same order: launch buckets strictly in bucket order "
     "(a full bucket waits for the ones before it), even when ranks produce gradients in different "
     "orders or use different parameters."),
    (r"truncated; \d+ bytes received but buffer size is \d+|Message truncated",
     "a rank received a message of another size than its buffer: the ranks disagree on how big a "
     "message is. Did you split a tensor whose size is not divisible by N with chunk() (it may return "
     "fewer, unequal pieces; tensor_split returns N), receive a chunk into a buffer of another chunk's "
     "size, or issue collectives in different orders on different ranks?"),
    (r"Buffers must not be aliased|Invalid buffer pointer",
     "a collective's send buffer lies inside its receive buffer. MPI may not read from memory it "
     "writes into: copy the part you send into a new tensor first."),
    (r"(all_gather|reduce_scatter|all_to_all): (output|input) .* must hold",
     "the two buffers of a gather/scatter do not fit: one must hold exactly N times the other. "
     "Is the part of the buffer you gather into (or scatter from) the sharded part only, padding "
     "included, and nothing else?"),
    (r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)|doesn't match the broadcast "
     r"shape|is invalid for input of size|size mismatch",
     "two tensors of different lengths met: an offset or a slice is off. Is the slice taken relative to "
     "the buffer's own start (a bucket's buffer begins at flat position bucket.lo, not 0), "
     "and does it handle the last, shorter chunk?"),
    (r"transient\.free\(.*no live buffer",
     "memory.transient.free(name) found no live buffer of that name: it was never allocated under that "
     "name (every transient.free needs the transient.alloc made when the buffer was created), or it was "
     "freed twice (something still points at the buffer after its first free, so it is freed "
     "again)."),
    (r"'NoneType' object has no attribute '(wait|is_completed)'",
     "a blocking collective returns None. Pass async_op=True to get a handle, and wait() on it later."),
    (r"assigned grad has data of a different type|assign a gradient with dtype|expected dtype .* but got|"
     r"invalid gradient at index",
     "a gradient must have its parameter's dtype (and shape): an fp32 master takes only an fp32 "
     "gradient, so cast a 16-bit one before it becomes the master's .grad."),
    (r"got (a second gradient|two gradients)",
     "a gradient arrived twice in one step: call finish after every backward, or run the earlier "
     "micro-batches under no_sync()."),
    (r"modified by an inplace operation",
     "a tensor autograd saved for backward was changed in place: write into a copy, or change it "
     "only after backward."),
    (r"died without a Python traceback",
     "a rank crashed in native code. Most often a buffer was freed, reused or read while a "
     "nonblocking collective still used it: wait() on every handle before you read, overwrite or "
     "drop its buffer."),
    (r"(?s)timed out after [\d.]+s: (?!.*\brank \d+ in )",  # no rank was blocked in a collective
     "no rank was waiting in a collective when time ran out: every rank was running its own code. An endless "
     "loop (a `while` whose condition never becomes false, an index that never advances) or code far too slow "
     "for the check's time limit; not a collective deadlock."),
    (r"timed out after",
     "a deadlock: the ranks wait in different collectives, or one rank never calls the collective "
     "the others wait in (the list above says where each rank was). Every rank must issue the same "
     "collectives in the same order, also for a parameter it did not use (send its zeros)."),
    (r"(ImportError|ModuleNotFoundError|SyntaxError|IndentationError|NameError)",
     "your lab file does not load: fix the error above (run `python labs/<your lab file>` to see it "
     "directly)."),
]


def likely_cause(text: str) -> str | None:
    """The hint for the first known signature in `text`, or None."""
    for pattern, hint in HINTS:
        if re.search(pattern, text):
            return hint
    return None


def with_hint(text: str) -> str:
    """`text` with its likely cause inserted under the first line (the raw message stays first)."""
    hint = likely_cause(text)
    if hint is None:
        return text
    head, _, rest = text.partition("\n")
    return f"{head}\nlikely cause: {hint}" + (f"\n{rest}" if rest else "")


def update_size_cause(ratio: float, n: int) -> str:
    """What |your step| / |the reference's step| says about the averaging (SGD: the step is lr times
    the gradient, so a gradient summed but not divided by N makes it N times too large)."""
    if ratio != ratio:  # nan
        return ""
    for factor, cause in ((n, "the gradients were summed over the ranks but not divided by N"),
                          (1 / n, "the gradients were divided by N twice"),
                          (2, "the step was taken twice, or the gradient counted twice"),
                          (0, "the parameters did not move: no optimizer step reached them")):
        if abs(ratio - factor) <= 0.02 * max(factor, 1):
            return f" Your step moved the weights {ratio:.3g}x as far as the reference's: {cause}."
    return ""
