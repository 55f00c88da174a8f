"""The spike guard's snapshots: host copies of the whole run (run_state.capture: model, optimizer, schedules,
counters, RNG) that a rollback returns to, and what they cost in host memory (docs/spike_guard.md).

A snapshot is taken every spike_guard_snapshot_interval iterations, and as many are kept as a rollback can
reach back (keep()); without one in memory, a rollback goes to the newest disk checkpoint in `save` or `load`."""
import collections
import copy as copy_module
import math
import os
import re

import torch

import checkpoint
import run_state
import schedule
from report import print0


class Snapshots:
    """A host copy of the run every spike_guard_snapshot_interval iterations, enough of them to reach as far
    back as a rollback can (keep()); older ones are dropped. Without one, the disk checkpoints in `save`.

    On CUDA the copies go into pinned host memory, non-blocking, on the compute stream: the copy is ordered
    before the next step's kernels that overwrite the weights, and the host waits for it (an event) only when
    it reads the snapshot back. The pinned buffers of the snapshot dropped are reused: pinning is slow."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.interval = cfg.spike_guard_snapshot_interval if cfg.spike_guard else 0
        self.keep = keep(cfg)
        self.items = []  # (iteration, snapshot, event or None), oldest first

    def maybe_take(self, iteration, parts):
        if not (self.interval and iteration % self.interval == 0):
            return
        self.items = [item for item in self.items if item[0] < iteration]
        spare = self.items.pop(0)[1] if len(self.items) >= self.keep else None
        copy, event = host_copy(run_state.capture(parts), spare)
        self.items.append((iteration, copy, event))

    def newest_before(self, start):
        """(iteration, snapshot) of the newest state at an iteration < start, from memory or else disk."""
        for it, snap, event in reversed(self.items):
            if it < start:
                if event is not None:
                    event.synchronize()
                return it, snap
        for directory in dict.fromkeys(d for d in (self.cfg.save, self.cfg.load) if d):
            if not os.path.isdir(directory):
                continue
            steps = [int(m.group(1)) for m in map(re.compile(r"global_step(\d+)$").match, os.listdir(directory))
                     if m and int(m.group(1)) < start]
            if steps:
                return max(steps), checkpoint.load(os.path.join(directory, f"global_step{max(steps)}"))
        return None

    def roll_back(self, decision, parts):
        """Carry out a rollback (or, for a stop, return to the last good state if there is one). Returns the
        iteration restored to, or None when there is nothing to roll back to."""
        found = self.newest_before(decision["start"]) if "start" in decision else None
        if found is None:
            if decision["action"] == "rollback":
                decision["action"] = "stop"
                decision["line"] = (f"spike guard: iteration {decision['iteration']}: no snapshot or checkpoint "
                                    f"before iteration {decision['start']} to roll back to")
                print0(decision["line"])
            parts.guard.applied(decision, None)
            return None
        target, snap = found
        run_state.restore(snap, parts, keep_payload=True)  # a snapshot can be rolled back to again
        self.items = [item for item in self.items if item[0] <= target]
        if decision.get("reset_optimizer"):
            run_state.reset_optimizer(parts, schedule.reset_warmup_iters(self.cfg, unset="auto"))
        parts.guard.applied(decision, target)
        skipping = decision["action"] == "rollback" and decision["end"] is not None
        print0(f"spike guard: rolled back to iteration {target}" + (
            f"; iterations {decision['start']}-{decision['end']} will be skipped" if skipping else ""))
        return target


def keep(cfg):
    """Snapshots a rollback can need. Strikes within spike_guard_rewind of the last one form an episode, so the
    first strike can be up to R back and the rollback goes R before it: to before iteration - 2R, i.e. to the
    newest snapshot up to one interval I further back. From that one to the newest: ceil(2R / I) + 1 snapshots.
    (Strikes at 1049, 1100, 1149 with R=100, I=50 roll back to 900, with 950-1100 taken since: 5.)"""
    interval = cfg.spike_guard_snapshot_interval if cfg.spike_guard else 0
    return math.ceil(2 * cfg.spike_guard_rewind / interval) + 1 if interval else 0


def host_copy(payload, spare=None):
    """(copy, event): every tensor of the payload copied to the host; with CUDA into pinned memory (the spare
    snapshot's buffers where shapes and dtypes match) by non-blocking copies, and a CUDA event that says when
    they have landed (None without CUDA, where the copies are done on return)."""
    spares = collections.defaultdict(list)
    for t in checkpoint.tensors(spare):
        spares[(t.shape, t.dtype)].append(t)
    cuda = [False]

    def copy(obj):
        if torch.is_tensor(obj):
            if obj.device.type != "cuda":
                return obj.detach().to("cpu", copy=True)
            cuda[0] = True
            pool = spares[(obj.shape, obj.dtype)]
            out = pool.pop() if pool else torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            return out.copy_(obj.detach(), non_blocking=True)
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy(v) for v in obj)
        return copy_module.deepcopy(obj)
    out = copy(payload)
    event = None
    if cuda[0]:
        event = torch.cuda.Event()
        event.record()
    return out, event



def snapshot_bytes(cfg, gpu_params, dp):
    """Host memory of the guard's snapshots per GPU: weights in the compute dtype and the optimizer state (fp32
    masters and Adam's moments for half precision, the moments for fp32; divided over DP with ZeRO-1)."""
    half = cfg.fp16 or cfg.bf16
    optimizer = (12 if half else 8) / (dp if cfg.zero_stage >= 1 else 1)
    return keep(cfg) * gpu_params * ((2 if half else 4) + optimizer)


def describe_snapshots(cfg, gpu_params, dp):
    """The dry run's line on the snapshots' host memory per GPU (None when the guard keeps none)."""
    if not keep(cfg):
        return None
    total = snapshot_bytes(cfg, gpu_params, dp)
    return (f"spike guard snapshots: {keep(cfg)} x {total / keep(cfg) / 2**30:.2f} GiB = {total / 2**30:.2f} GiB of "
            f"host memory per GPU (spike_guard_rewind {cfg.spike_guard_rewind}, spike_guard_snapshot_interval "
            f"{cfg.spike_guard_snapshot_interval}; x GPUs per node must fit the node's memory)")
