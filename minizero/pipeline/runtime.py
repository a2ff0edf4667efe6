"""The one small executor: run this rank's action list, nothing more.

    stage = PipelineStage(model, mesh, activation_shape=(micro_batch, T, n_embd))
    pipe = PipelineRuntime(stage, "1f1b", num_microbatches=8)
    loss = pipe.step(x, y)      # the batch, cut into 8; loss on the last stage, None elsewhere
    optimizer.step(); optimizer.zero_grad()

For each action of `schedule.actions[rank]`:
  F(k, c)  receive chunk c's input (unless it is virtual stage 0: micro-batch k of `inputs`), run
           the chunk, send the output on (or, on the last stage, compute loss_k / m); keep what
           the backward needs until the action that ends it.
  B(k, c)  receive the output's gradient (the loss on the last stage needs none), backward; send
           the input's gradient back. In split schedules only the input gradient (split_backward).
  W(k, c)  the weight gradients of (k, c); frees what F kept.
Sends are asynchronous and never waited for before the end of the step, receives block: exactly
the model `schedules.simulate` checks for deadlocks. The next action's receive is posted before the
current action computes (prefetch), so its message can arrive meanwhile; tags keep them apart.
The gradient of the step is the sum over micro-batches of grad(loss_k / m): the gradient of the
mean loss over the batch, as one process computes it on the whole batch. Then the tied weights'
gradients are summed between the first and last stage (stage.reduce_tied_gradients).

Data parallelism is the caller's: pass `data_parallel`, anything with no_sync() (minizero or torch
DDP), and every backward but the last of the step runs inside it, so the gradients are reduced once
per step; finish_gradient_synchronization() is called after the schedule when it exists. ZeRO-1
needs nothing: its hooks accumulate, and its step() reduce-scatters.

Measured on every step (pipe.last):
  * events: (action, start, compute start, end) on time.perf_counter(), one clock for all ranks of
    a machine: the real timeline, and the bubble = 1 - busy / step time;
  * the activations held for backward: a memory.SavedTensors meter around every F sees each tensor
    autograd saves (parameters excluded) and when autograd frees it; after every action the live
    bytes (plus, in split schedules, the gradients B keeps for W) go to minizero.memory.transient
    (the ledger's transient high-water mark), and each F's increase is that micro-batch's bytes;
  * the most micro-batches (chunk-activations) held at once, counted from F to the action that
    frees them.
`verbose=True` prints every action as it runs (picotron's VERBOSE).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from minizero import memory
from minizero.comm.backends import heartbeat
from minizero.pipeline.schedules import Action, Schedule, make_schedule
from minizero.pipeline.split_backward import SplitBackward
from minizero.pipeline.stage import PipelineError, PipelineStage


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> tuple[torch.Tensor, ...]:
    """The batch cut into equal micro-batches along dim 0 (views)."""
    if batch.shape[0] % num_microbatches:
        raise PipelineError(f"a batch of {batch.shape[0]} does not split into {num_microbatches} "
                            f"micro-batches: use a batch size divisible by {num_microbatches} "
                            "(train_batch_size = micro batch x micro-batches x dp)")
    return batch.chunk(num_microbatches)


class PipelineRuntime:
    """Executes `schedule` (a name or a Schedule) on `stage` for `num_microbatches` per step."""

    def __init__(self, stage: PipelineStage, schedule: str | Schedule = "1f1b",
                 num_microbatches: int | None = None, data_parallel=None, verbose: bool = False,
                 poll_s: float | None = 1e-4, measure: bool = True, prefetch: bool = True):
        if isinstance(schedule, str):
            if num_microbatches is None:
                raise PipelineError("PipelineRuntime: give num_microbatches with a schedule name")
            schedule = make_schedule(schedule, stage.num_stages, num_microbatches, stage.num_chunks)
        if (schedule.num_stages, schedule.num_chunks) != (stage.num_stages, stage.num_chunks):
            raise PipelineError(f"schedule {schedule.name!r} is for p={schedule.num_stages}, "
                                f"v={schedule.num_chunks}; the stage has p={stage.num_stages}, "
                                f"v={stage.num_chunks}")
        self.stage = stage
        self.schedule = schedule
        self.actions = schedule.actions[stage.rank]        # what this rank runs, in order
        self.num_microbatches = schedule.num_microbatches
        self.data_parallel = data_parallel  # its no_sync() wraps all backwards but the last
        self.verbose = verbose
        self.poll_s = poll_s                               # sleep between polls while receiving
        self.measure = measure  # meter the activations (off: no hook of ours)
        self.prefetch = prefetch  # post the next action's receive before this one runs
        frees = "W" if schedule.split_backward else "B"
        self.last_backward = max(i for i, a in enumerate(self.actions) if a.kind == frees)
        self.last = {}                                     # measurements of the last step
        # the state of one step, reset by step():
        self._inputs = self._targets = None  # this step's micro-batches (first / last stage)
        self._meter = memory.SavedTensors()                # the activations autograd keeps, live
        self._kept = {}  # (k, c) -> (input, output) after F, SplitBackward after B
        self._sends = []  # (work, buffer): sends in flight, waited at the end
        self._losses = []  # loss_k / m of each micro-batch (last stage)
        self._held = 0  # micro-batches between F and the action that frees them
        self._posted = {}  # (kind, k, c) -> (buffer, work): receives posted ahead

    # ------------------------------------------------------------------ inputs
    def _split(self, name, batch, needed):
        if not needed:
            return None
        if batch is None:
            raise PipelineError(f"this rank holds the {'first' if name == 'inputs' else 'last'} "
                                f"stage: pipe.step needs the {name}")
        return split_microbatches(batch, self.num_microbatches)

    # ------------------------------------------------------------------ the step
    def step(self, inputs=None, targets=None):
        """One pipeline step over the batch: forward and backward of every micro-batch. Returns the
        mean loss over the micro-batches on the rank holding the last stage, None elsewhere."""
        stage = self.stage
        first = any(stage.is_first(c) for c in range(stage.num_chunks))
        last = any(stage.is_last(c) for c in range(stage.num_chunks))
        self._inputs = self._split("inputs", inputs, first)
        self._targets = self._split("targets", targets, last)
        self._meter = memory.SavedTensors(exclude=stage.parameters())
        self._kept, self._sends, self._losses, self._posted = {}, [], [], {}
        self._held = 0
        activation_bytes = {}                             # "F3.1" -> bytes that F left for backward
        events, peak_held, peak_bytes = [], 0, 0
        for i, action in enumerate(self.actions):
            heartbeat.set_context(f"pipeline action {action} on stage "
                                  f"{action.chunk * stage.num_stages + stage.rank}")
            t0 = time.perf_counter()
            if self.prefetch and i + 1 < len(self.actions):
                # its message can arrive while this action computes
                self._post_recv(self.actions[i + 1])
            before = self._meter.live
            run = {"F": self._forward, "B": self._backward, "W": self._weight}[action.kind]
            sync = self.data_parallel is not None and i != self.last_backward and action.kind != "F"
            with self.data_parallel.no_sync() if sync else nullcontext():
                t1 = run(action.microbatch, action.chunk)  # returns when its receive was done
            t2 = time.perf_counter()
            if action.kind == "F":
                activation_bytes[str(action)] = self._meter.live - before
            held_bytes = self._meter.live + sum(s.kept_bytes() for s in self._kept.values()
                                                # + B's gradients kept for W
                                                if isinstance(s, SplitBackward))
            memory.transient.alloc("pipeline.activations", held_bytes)  # the live bytes, now
            peak_held, peak_bytes = max(peak_held, self._held), max(peak_bytes, held_bytes)
            events.append((str(action), t0, t1, t2))
            if self.verbose:
                print(f"[pp {stage.rank}] {action!s:<6} wait {1e3 * (t1 - t0):7.2f} ms  compute "
                      f"{1e3 * (t2 - t1):7.2f} ms  held {self._held}", flush=True)
        heartbeat.set_context("pipeline: the step's last sends and gradient reductions")
        for work, _ in self._sends:
            work.wait(sleep_s=self.poll_s)
        if self.data_parallel is not None and hasattr(self.data_parallel,
                                                      "finish_gradient_synchronization"):
            self.data_parallel.finish_gradient_synchronization()
        stage.reduce_tied_gradients()
        heartbeat.set_context("")
        memory.transient.free("pipeline.activations")
        self.last = {"events": events, "peak_in_flight": peak_held,
                     "peak_activation_bytes": peak_bytes, "activation_bytes": activation_bytes}
        losses, self._kept, self._sends, self._losses = self._losses, {}, [], []
        return torch.stack(losses).sum() if losses else None

    def _post_recv(self, action):
        """Post the receive `action` needs (if any, and not posted yet): F gets its input, B its
        output's gradient. The buffer and the handle wait in self._posted until the action runs."""
        k, c, stage = action.microbatch, action.chunk, self.stage
        key = (action.kind, k, c)
        if key in self._posted:
            return
        if action.kind == "F" and not stage.is_first(c):
            self._posted[key] = stage.recv_activation(k, c)
        elif action.kind == "B" and not stage.is_last(c):
            self._posted[key] = stage.recv_gradient(k, c)

    def _received(self, kind, k, c):
        self._post_recv(Action(kind, k, c))
        buf, work = self._posted.pop((kind, k, c))
        work.wait(sleep_s=self.poll_s)
        return work.buffer if buf is None else buf  # None: a learned shape's, made once it came

    def _forward(self, k, c):
        stage = self.stage
        if stage.is_first(c):
            x = self._inputs[k]
        else:
            x = self._received("F", k, c)
            x.requires_grad_()
        t1 = time.perf_counter()
        with self._meter.hooks() if self.measure else nullcontext():
            out = stage.chunks[c](x)
            if stage.is_last(c):
                out = stage.loss_fn(out, self._targets[k]) / self.num_microbatches
                self._losses.append(out.detach())
            elif stage.activation_shape is not None and tuple(out.shape) != stage.activation_shape:
                raise PipelineError(f"chunk {c} (virtual stage {stage.chunks[c].index}) returned "
                                    f"shape {tuple(out.shape)}, but the pipe carries "
                                    f"{stage.activation_shape}: give PipelineStage the "
                                    "activation_shape of one micro-batch")
        if not stage.is_last(c):
            send = out.detach()  # keep the buffer until the send is done, not the graph behind it
            self._sends.append((stage.send_activation(send, k, c), send))
        self._kept[(k, c)] = (x, out)
        self._held += 1
        return t1

    def _backward(self, k, c):
        stage = self.stage
        x, out = self._kept.pop((k, c))
        grad = None if stage.is_last(c) else self._received("B", k, c)
        t1 = time.perf_counter()
        if self.schedule.split_backward:  # B: the input's gradient only; W comes later
            split = SplitBackward(out, x, stage.chunks[c].parameters())
            grad_input = split.input_gradient(grad)
            self._kept[(k, c)] = split  # holds only what W needs: the graph below the meeting nodes
        else:
            torch.autograd.backward(out, grad)  # frees the saved activations
            grad_input = x.grad if x.requires_grad else None
            self._held -= 1
        if grad_input is not None and not stage.is_first(c):
            self._sends.append((stage.send_gradient(grad_input, k, c), grad_input))
        return t1

    def _weight(self, k, c):
        t1 = time.perf_counter()
        self._kept.pop((k, c)).weight_gradient()  # the graph and the kept gradients die here
        self._held -= 1
        return t1


def bubble(events_per_rank) -> dict:
    """From every rank's events of one step (allgather them): step time, busy time per rank, and
    the bubble, the idle fraction: 1 - sum(busy) / (ranks x step time)."""
    start = min(ev[0][1] for ev in events_per_rank)
    end = max(ev[-1][3] for ev in events_per_rank)
    busy = [sum(e[3] - e[2] for e in ev) for ev in events_per_rank]
    return {"step_s": end - start, "busy_s": busy,
            "bubble": 1 - sum(busy) / (len(busy) * (end - start))}
