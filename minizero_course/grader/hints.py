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


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
               "barrier", "allgather_object")
# what a rank's heartbeat said (comm/backends.describe_ranks), the op's words and group name apart
_P2P = re.compile(r"(send to|recv from) rank (\d+) of \S+(?: \(job rank (\d+)\))? \((\d+) B\)")
_COLLECTIVE = re.compile(r"(\w+)(?: \((\d+) B\))? on \S+$")


def _operation(text: str) -> tuple[str, str]:
    """('p2p' | 'collective' | '', the op in a student's words) of one heartbeat op text."""
    text = re.sub(r" \[during .*\]$", "", text)
    if m := _P2P.match(text):
        peer = m.group(3) or m.group(2)  # the job's rank, as the report names every rank
        what = (f"recv from rank {peer} ({m.group(4)} B)" if m.group(1) == "recv from"
                else f"send to rank {peer} ({m.group(4)} B)")
        return "p2p", what
    if (m := _COLLECTIVE.match(text)) and m.group(1) in COLLECTIVES:
        size = f" ({m.group(2)} B)" if m.group(2) else ""
        return "collective", f"the collective {m.group(1)}{size}"
    if m and m.group(1) in ("send", "recv"):  # posting it (before its peer is written down)
        return "p2p", m.group(1) + (f" ({m.group(2)} B)" if m.group(2) else "")
    return "", text


def _rank_line(rank: int, where: str) -> tuple[str, str]:
    """(the kind it was blocked in or '', a line on what rank `rank` did when time ran out)."""
    during = re.search(r" \[during (.*)\]\)?$", where)
    context = f", during {during.group(1)}" if during else ""
    if where.startswith("in "):
        kind, what = _operation(where[3:])
        if kind == "p2p" and what.startswith("recv from"):
            peer = what.split()[3]
            return kind, (f"rank {rank}: blocked in {what}{context}: waiting for a message "
                          f"rank {peer} never sent")
        if kind == "p2p" and what.startswith("send to"):
            peer = what.split()[3]
            return kind, f"rank {rank}: blocked in {what}{context}: rank {peer} never received it"
        return kind, f"rank {rank}: blocked in {what}{context}"
    if m := re.search(r"\(idle \(in flight: (.*)\)\)$", where):
        return "", (f"rank {rank}: running its own code, not communicating, with a "
                    f"{_operation(m.group(1))[1]} posted and never waited for")
    if m := re.search(r"\(idle \(last: (?:wait )?(.*)\)\)$", where):
        return "", (f"rank {rank}: running its own code, not communicating (its last one: "
                    f"{_operation(m.group(1))[1]})")
    if where.startswith("had not reached"):
        return "", f"rank {rank}: had not communicated yet (starting up, or in its own code)"
    return "", f"rank {rank}: {where}"


def timeout_message(seconds: float, where: dict) -> str:
    """A timeout in a student's words: which kind of operation hung (point-to-point or collective,
    and which), on which rank, then the likely cause. No communicator's name: the grader's own
    sub-groups mean nothing to the student; every rank is named by its rank in the job."""
    lines = [_rank_line(r, w) for r, w in sorted(where.items())]
    kinds = {kind for kind, _ in lines if kind}
    blocked = [line.split(":")[0].split()[1] for kind, line in lines if kind]
    ranks = ("rank " if len(blocked) == 1 else "ranks ") + ", ".join(blocked)
    if kinds == {"p2p"}:
        head = (f"a point-to-point deadlock: {ranks} waited in a send or recv that no rank "
                "matched")
        cause = ("every recv needs the matching send on the rank it names (and every send a recv "
                 "there), posted before that rank blocks in something else; post sends with isend "
                 "and wait() on each handle only after the recv, so no rank blocks first (the list "
                 "below says which message each rank waited for).")
    elif kinds == {"collective"}:
        head = (f"a deadlock in collectives: {ranks} waited in a collective that not every rank "
                "called")
        cause = ("a deadlock: the ranks wait in different collectives, or one rank never calls the "
                 "collective the others wait in (the list below says where each rank was). Every "
                 "rank must issue the same collectives in the same order, also for a parameter it "
                 "did not use (send its zeros).")
    elif kinds:
        head = "a deadlock: some ranks waited in a send or recv, others in a collective"
        cause = ("the ranks' communication went out of step: a rank blocked in a collective "
                 "while another waits for its message (or the reverse). Every send needs its recv "
                 "before either rank enters a collective, and every rank must issue the same "
                 "collectives in the same order.")
    else:
        head = "no rank was blocked in communication"
        cause = ("no rank was waiting in a collective when time ran out: every rank was running "
                 "its own code. An endless loop (a `while` whose condition never becomes false, an "
                 "index that never advances) or code far too slow for the check's time limit; not "
                 "a collective deadlock.")
    return (f"timed out after {seconds:g}s: {head}\nlikely cause: {cause}\n"
            + "\n".join(f"  {line}" for _, line in lines))


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
