"""The spike guard's snapshots: copies of the whole run (run_state.capture: model, optimizer, schedules, counters,
RNG) that a rollback returns to, and what they cost in host memory (docs/spike_guard.md).

A snapshot is taken every spike_guard_snapshot_interval iterations, and as many are kept as a rollback can
reach back (keep()): in host memory, or with spike_guard_snapshot_dir in one file per rank on a node-local disk.
Without one old enough, a rollback goes to the newest disk checkpoint in `save` or `load`. The run refuses to
start when the snapshots would not fit in the node's memory (check_host_memory), and the dry run says so."""

import glob
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

import checkpoint
import parallel
import run_state
import safety
import training
from report import print0

# of the node's memory the snapshots may take; the rest: the processes, data workers, page cache
HOST_SHARE = 0.75


@dataclass
class SnapshotConfig:  # Snapshots: the states a rollback returns to
    # -- stability: the spike guard's snapshots --
    # a CPU copy of the run every N iterations to roll back to (0: disk only)
    spike_guard_snapshot_interval: int = 50
    # node-local disk ($SLURM_TMPDIR): snapshots there, not in host memory
    spike_guard_snapshot_dir: str | None = None

    # sections.py; the snapshots' interval is the replica check's default too
    SWITCHED = {"spike_guard": ("spike_guard_snapshot_dir",)}


class Snapshots:
    """A copy of the run every spike_guard_snapshot_interval iterations, enough of them to reach as far back as
    a rollback can (keep()); older ones are dropped. Without one, the disk checkpoints in `save`.

    In host memory: on CUDA the copies go into pinned buffers, non-blocking, on the compute stream: the copy is
    ordered before the next step's kernels that overwrite the weights, and the host waits for it (an event) only
    when it reads the snapshot back. The buffers of the snapshot dropped are reused: pinning is slow.
    With spike_guard_snapshot_dir: each rank's snapshot is one file there, written in the background by a
    checkpoint.AsyncWriter (one snapshot of host memory, its buffers), read back on a rollback, deleted when
    dropped and at the run's end. model: this rank's, to check at the start that the snapshots fit."""

    Config = SnapshotConfig  # its section: stability.build_callbacks builds it with it

    def __init__(self, plan, checkpoint_dirs=(None, None), reset_warmup=0, model=None, saver=None):
        """plan: a Plan (stability.snapshot_plan); checkpoint_dirs: the run's save and load, whose
        disk checkpoints a rollback returns to too; reset_warmup: the lr=0 iterations of a relapse's
        optimizer reset; saver: the run's checkpoint.AsyncWriter, which saves a state rolled back to
        from the disk (roll_back)."""
        self.plan, self.reset_warmup, self.save_dir, self.saver = (
            plan,
            reset_warmup,
            checkpoint_dirs[0],
            saver,
        )
        self.dirs = [d for d in dict.fromkeys(checkpoint_dirs) if d]
        self.interval = plan.interval
        self.keep = keep(plan)
        self.items = []  # (iteration, snapshot or its file, event or None, buffers), oldest first
        self.dir = plan.directory if self.keep else None
        if model is not None:
            self.check_fits(model)
        if self.dir:
            try:  # config.check refused what it could see; what changed since is said alike
                os.makedirs(self.dir, exist_ok=True)
            except OSError as e:
                raise ValueError(
                    f"spike_guard_snapshot_dir={self.dir} cannot be created ({e}): "
                    "give a directory the run can create or write (a node-local "
                    "disk, e.g. $SLURM_TMPDIR)"
                ) from e
            # Two runs given one directory deleted each other's snapshots and could restore each other's
            # weights: each rank holds a lock of its own there (its files are the only ones it touches).
            self.lock = safety.acquire_lock(
                self.dir,
                "--spike_guard_snapshot_dir",
                name=f"snapshot-rank{parallel.grid.rank:05d}.lock",
            )
            for leftover in glob.glob(self.path("*") + "*"):  # this rank's, from a run that crashed
                os.remove(leftover)
            self.writer = checkpoint.AsyncWriter()

    def check_fits(self, model):
        """Refuse (ValueError) snapshots that would not fit in the node's memory; model: this rank's."""
        if not self.keep:
            return
        one, node = rank_snapshot_bytes(self.plan, model), node_memory()
        # the largest rank's and the smallest node's: one verdict on every rank
        if dist.is_initialized():
            both = torch.tensor([one, -node], dtype=torch.int64, device=parallel.comm_device())
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            one, node = both[0].item(), -both[1].item()
        check_host_memory(self.plan, one, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), node)

    def path(self, iteration):
        return os.path.join(
            self.dir, f"snapshot-rank{parallel.grid.rank:05d}-iteration{iteration}.pt"
        )

    def maybe_take(self, iteration, parts):
        if not (self.interval and iteration % self.interval == 0):
            return
        self.drop(lambda it: it >= iteration)
        spare = {}
        if len(self.items) >= self.keep:
            oldest, *_, spare = self.items[0]
            self.drop(lambda it: it == oldest)
        if self.dir:
            self.wait()  # the previous write's failure, said as ours
            self.writer.write(self.path(iteration), run_state.capture(parts))
            self.items.append((iteration, self.path(iteration), None, None))
        else:
            copy, event = checkpoint.host_copy(run_state.capture(parts), spare)
            self.items.append((iteration, copy, event, spare))

    def drop(self, which):
        """Forget the snapshots of the iterations which(iteration) is true of; their files are deleted."""
        for it, snap, *_ in self.items:
            if which(it) and isinstance(snap, str):
                self.wait()
                os.remove(snap)
        self.items = [item for item in self.items if not which(item[0])]

    def wait(self):
        """Until the snapshot being written is on disk; a failed write stops the run with what to change."""
        try:
            self.writer.wait()
        except OSError as e:
            raise ValueError(
                f"a spike guard snapshot could not be written to spike_guard_snapshot_dir {self.dir} "
                f"({e}); free space there, or point spike_guard_snapshot_dir at another local disk"
            ) from e

    def close(self):
        """At the run's end: the snapshot files deleted, the directory's lock released."""
        self.drop(lambda it: True)
        if self.dir:
            safety.release_lock(self.lock)

    def newest_before(self, start):
        """(iteration, snapshot) of the newest state at an iteration < start, from memory or else disk."""
        for it, snap, event, _ in reversed(self.items):
            if it < start:
                if isinstance(snap, str):
                    self.wait()
                    return it, torch.load(snap, map_location="cpu", weights_only=False, mmap=True)
                if event is not None:
                    event.synchronize()
                return it, snap
        for directory in self.dirs:
            if not os.path.isdir(directory):
                continue
            steps = [
                int(m.group(1))
                for m in map(re.compile(r"global_step(\d+)$").match, os.listdir(directory))
                if m and int(m.group(1)) < start
            ]
            if steps:
                return max(steps), checkpoint.load(
                    os.path.join(directory, f"global_step{max(steps)}")
                )
        return None

    def oldest(self, disk=True):
        """(iteration, snapshot) of the oldest state there is: the oldest snapshot kept or (disk) the oldest disk
        checkpoint in `save` or `load`, whichever is older; None for neither."""
        kept = [self.items[0][0]] if self.items else []
        kept += self.checkpoints()[:1] if disk else []
        return self.newest_before(min(kept) + 1) if kept else None

    def checkpoints(self):
        """The iterations of the disk checkpoints in `save` and `load`."""
        found = set()
        for directory in self.dirs:
            if os.path.isdir(directory):
                found |= {
                    int(m.group(1))
                    for m in map(re.compile(r"global_step(\d+)$").match, os.listdir(directory))
                    if m
                }
        return sorted(found)

    def roll_back(self, decision, parts, guard):
        """Carry out a rollback (or, for a stop, return to the last good state if there is one). Returns the
        iteration restored to, or None when there is nothing to roll back to (the decision is then a stop)."""
        found = self.newest_before(decision["start"]) if "start" in decision else None
        if found is None and decision["action"] == "rollback":
            found = self.oldest_instead(decision)
        if found is None:
            if decision["action"] == "rollback":
                decision["action"] = "stop"
                decision["line"] = (
                    f"spike guard: iteration {decision['iteration']}: {decision['reason']}: stopped, "
                    f"the last resort: no snapshot or checkpoint before iteration "
                    f"{decision['iteration'] - 1} to roll back to (save=DIR keeps checkpoints, "
                    "spike_guard_snapshot_interval snapshots)"
                )
                print0(decision["line"])
            guard.applied(decision, None)
            return None
        target, snap = found
        from_disk = not any(it == target for it, *_ in self.items)
        run_state.restore(snap, parts, keep_payload=True)  # a snapshot can be rolled back to again
        self.drop(lambda it: it > target)
        if decision.get("reset_optimizer"):
            run_state.reset_optimizer(parts, self.reset_warmup)
        guard.applied(decision, target)
        skipping = decision["action"] == "rollback" and decision["end"] is not None
        print0(
            f"spike guard: rolled back to iteration {target}{decision.get('fallback', '')}"
            + (
                f"; iterations {decision['start']}-{decision['end']} will be skipped"
                if skipping
                else ""
            )
        )
        # (a stop saves anyway)
        if from_disk and self.save_dir and decision["action"] == "rollback":
            # saved again at once, with the decision: `latest` named a checkpoint of the timeline left
            # behind (after target), which a run killed before its next save would resume from
            run_state.save(parts, self.saver)
        return target

    def oldest_instead(self, decision):
        """A rollback whose target lies before every state kept (before the resume point, or the oldest snapshot):
        the oldest state there is, when it is before the spike's own state -- the data is skipped and the cause
        answered as decided, from there -- and the decision's line says so; else None. A hardware rollback gets
        none: every state it could reach holds the corrupted weight."""
        found = self.oldest()
        if (
            found is None
            or found[0] >= decision["iteration"] - 1
            or decision.get("cause") == "hardware"
        ):
            return None
        target, start = found[0], decision["start"]
        where = (
            "the oldest snapshot"
            if self.items and self.items[0][0] == target
            else "the oldest checkpoint"
        )
        decision["fallback"] = (
            f" (the oldest state there is, {where}: the target, before iteration {start}, is "
            "before every state kept)"
        )
        decision["line"] += (
            f"; no state before iteration {start} exists: rolled back to iteration {target}"
        )
        return found


class Snapshotting(training.Callback):
    """The snapshots (the store the guard and its forensics share, stability.Shared) checked to fit at the start,
    taken after each spike_guard_snapshot_interval-th iteration, deleted at the end."""

    Config = SnapshotConfig  # its section: stability.build_callbacks builds it with it

    name = "snapshots"

    def __init__(self, snapshot_cfg, shared):  # its keys are the store's (stability.snapshot_plan)
        self.snapshots = shared.snapshots

    def start(self, parts, report, train_data):
        self.parts = parts
        self.snapshots.check_fits(parts.model)

    def after_iteration(self, iteration):
        self.snapshots.maybe_take(iteration, self.parts)

    def close(self):
        self.snapshots.close()


@dataclass(frozen=True)
class Plan:
    """What the snapshots' number, place and size depend on (made by stability.snapshot_plan)."""

    interval: int  # a snapshot every N iterations: spike_guard_snapshot_interval (guard off: 0)
    rewind: int  # spike_guard_rewind: how far back a rollback can reach
    directory: str | None  # spike_guard_snapshot_dir
    half: bool  # fp16 or bf16 weights, with fp32 masters
    zero1: bool  # the optimizer state divided over DP (zero_stage >= 1)
    engine: bool  # DeepSpeed's engine holds the optimizer state (deepspeed)
    async_copy: bool  # async_save keeps a copy of the run's size in host memory too


def keep(plan):
    """Snapshots a rollback can need. Strikes within spike_guard_rewind of the last one form an episode, so the
    first strike can be up to R back and the rollback goes R before it: to before iteration - 2R, i.e. to the
    newest snapshot up to one interval I further back. From that one to the newest: ceil(2R / I) + 1 snapshots.
    (Strikes at 1049, 1100, 1149 with R=100, I=50 roll back to 900, with 950-1100 taken since: 5.)"""
    interval = plan.interval
    return math.ceil(2 * plan.rewind / interval) + 1 if interval else 0


def snapshot_bytes(plan, gpu_params, dp, optimizer_params=None):
    """Bytes of one snapshot per GPU: weights in the compute dtype and the optimizer state (fp32 masters and
    Adam's moments for half precision, the moments for fp32) of optimizer_params parameters: by default all of
    them, divided over DP with ZeRO-1 (native ZeRO-1 deals out whole parameters: the dry run gives its largest)."""
    half = plan.half
    if optimizer_params is None:
        optimizer_params = gpu_params / (dp if plan.zero1 else 1)
    return gpu_params * (2 if half else 4) + optimizer_params * (12 if half else 8)


def rank_snapshot_bytes(plan, model, pinned=None):
    """Bytes of this rank's snapshot: its parameters, and the optimizer state of those it owns under native
    ZeRO-1 (parallel.deal_out; DeepSpeed's even share: snapshot_bytes' default). pinned (default: when the
    parameters are on a GPU, whose copies go to pinned buffers): each host buffer as the caching host allocator
    rounds it (checkpoint.pinned_bytes), one per tensor: a parameter's weight, and its fp32 master and Adam's two
    moments (the moments alone for fp32); DeepSpeed's flat partitions, one per state."""
    params = [p for p in parallel.unwrap(model).parameters()]
    trainable = [p for p in params if p.requires_grad]
    g = parallel.grid
    owned = None
    if plan.zero1 and not plan.engine:
        owners = parallel.deal_out([p.numel() for p in trainable], g.dp_size)
        owned = [p for p, rank in zip(trainable, owners) if rank == g.dp_rank]
    if not (any(p.is_cuda for p in params) if pinned is None else pinned):
        return int(
            snapshot_bytes(
                plan,
                sum(p.numel() for p in params),
                g.dp_size,
                None if owned is None else sum(p.numel() for p in owned),
            )
        )
    rounded, states = checkpoint.pinned_bytes, 3 if plan.half else 2
    weights = sum(rounded(p.numel() * p.element_size()) for p in params)
    if plan.engine and plan.zero1:
        return weights + states * rounded(
            4 * math.ceil(sum(p.numel() for p in trainable) / g.dp_size)
        )
    return weights + sum(
        states * rounded(4 * p.numel()) for p in (trainable if owned is None else owned)
    )


def host_copies(plan):
    """Copies of the run in host memory per GPU: the snapshots (keep(plan), or with
    spike_guard_snapshot_dir one: the buffers of the background write), and with async_save one
    more, the buffers checkpoint.AsyncWriter keeps from one save to the next (a checkpoint holds
    what a snapshot holds: run_state.capture)."""
    return (min(keep(plan), 1) if plan.directory else keep(plan)) + int(plan.async_copy)


def node_memory():
    """Bytes of memory this node gives the job: the physical memory, or less under a cgroup's limit (SLURM's
    --mem), the tightest of this process's cgroup and its parents."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            files = [f"/sys/fs/cgroup{p}/memory.max" for p in parents(path)]
        elif "memory" in controllers.split(","):  # v1
            files = [f"/sys/fs/cgroup/memory{p}/memory.limit_in_bytes" for p in parents(path)]
        else:
            continue
        for name in files:
            try:
                with open(name) as f:
                    value = f.read().strip()
            except OSError:
                continue
            if value.isdigit():
                limit = min(limit, int(value))
    return limit


def parents(path):
    """A cgroup's path and its parents' up to the root: /a/b, /a, (the root)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:n]) if n else "" for n in range(len(parts), -1, -1)]


def describe_host_memory(plan, one, gpus_per_node, node_bytes=None):
    """(line, problem): the host memory of the snapshots (`one`: the bytes of one, snapshot_bytes or
    rank_snapshot_bytes), with async_save's copy of the same size, per GPU and per node, and None or, when they
    take more than HOST_SHARE of the node's memory, one message naming how many fit and the keys that make them
    fit. (None, None) when the guard keeps no snapshot."""
    if not keep(plan):
        return None, None
    copies, node = host_copies(plan), node_bytes or node_memory()
    GiB, rewind, interval = 2**30, plan.rewind, plan.interval
    what = "spike guard snapshots" + (" and async_save's copy" if plan.async_copy else "")
    where = f" (and {keep(plan)} on disk in {plan.directory})" if plan.directory else ""
    line = (
        f"{what}: {copies} x {one / GiB:.2f} GiB = {copies * one / GiB:.2f} GiB of host memory per "
        f"GPU{where}, x {gpus_per_node} GPUs per node = {copies * one * gpus_per_node / GiB:.1f} GiB of the node's "
        f"{node / GiB:.0f} GiB (spike_guard_rewind {rewind}, spike_guard_snapshot_interval {interval})"
    )
    fit = int(HOST_SHARE * node // (one * gpus_per_node))
    if copies <= fit:
        return line, None
    room = fit - int(plan.async_copy)  # snapshots that fit beside the async save's copy
    fixes = []
    if room >= 2:
        fixes.append(
            f"keep fewer (spike_guard_snapshot_interval {math.ceil(2 * rewind / (room - 1))} or more, or "
            f"spike_guard_rewind {(room - 1) * interval // 2} or less: ceil(2 x rewind / interval) + 1 are "
            "kept)"
        )
    if not plan.directory and room >= 1:
        fixes.append(
            "keep them on a node-local disk (spike_guard_snapshot_dir=$SLURM_TMPDIR or /tmp: one in host "
            f"memory, {keep(plan)} x {one / GiB:.2f} GiB per GPU on the disk)"
        )
    if plan.async_copy:
        fixes.append("save synchronously (async_save=false: one copy fewer)")
    fixes.append("roll back to the checkpoints in save only (spike_guard_snapshot_interval=0)")
    problem = (
        f"{what} need {copies * one * gpus_per_node / GiB:.1f} GiB of host memory per node "
        f"({copies} x {one / GiB:.2f} GiB per GPU x {gpus_per_node} GPUs), more than {HOST_SHARE:.0%} of the "
        f"node's {node / GiB:.0f} GiB: {fit} per GPU fit. To fit: " + "; or ".join(fixes)
    )
    return line, problem


def check_host_memory(plan, one, gpus_per_node, node_bytes=None):
    """At the run's start: one ValueError with the fix when the snapshots would not fit in the node's memory."""
    line, problem = describe_host_memory(plan, one, gpus_per_node, node_bytes)
    if problem:
        raise ValueError(problem)
    if line:
        print0(line)
