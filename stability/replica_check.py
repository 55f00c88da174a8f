"""The DP replicas compared (lesson 18's TP check, for data parallelism): every dp_replica_check_interval
iterations each rank reduces its weights and optimizer state to exact checksums, and one all-gather tells every
rank what all the others hold.

The DP replicas apply the same update from the same reduced gradients, so they stay bitwise identical -- unless a
GPU corrupts one of them. The step's agree() (training.py) cannot see that: it compares a DP-averaged loss and the
norm of reduced gradients, equal by construction; and a flip in a low exponent bit (bit 23 or 24 of an fp32: x2 or
x4) is no spike either. Such a replica drifts from the others silently, for the rest of the run.

  checksum   per rank, three int64: the sums of the bit patterns, as integers, of the weights, of the fp32
             masters (of half-precision weights) and of the optimizer's state (Adam's moments). Integer sums are
             exact, so every rank gets the same number whatever the order of the sum, and one flipped bit moves it
             by 2^k (a float sum would round a low mantissa bit away).
  compared   within each DP group (ranks with the same TP and PP rank). Under ZeRO-1 or DeepSpeed each DP
             rank holds the optimizer state of its own shard, which no other replica has: only the weights are
             compared. A flipped moment or master there corrupts its owner's updates, which every replica then
             receives alike -- no replica differs, and only the spike guard can notice.
  act        the replicas that differ from the majority of their group are named (DP and global rank; each prints
             its host), their state is copied from the majority's lowest DP rank, and the finding counts as a
             hardware fault of their DP rank (the spike guard's count and cap, when it is on). Two replicas that
             differ have no majority: the guard, with a snapshot taken at or before the last check that agreed,
             rolls back to it; without one DP rank 0's copy is taken, and the line says so.
  cost       nothing on other iterations; on a check, one pass over this rank's weights and optimizer state, one
             all-gather of 3 int64 per rank over all ranks (every rank reads every group's verdict: a rollback is
             everyone's) and one host read of the result. That read is not deferred to the next step's sync
             (agree()): the verdict comes before any step computes with a corrupted copy, so a re-sync leaves no
             trace in the healthy replicas' gradients.

The check runs after the step and the guard's decision (a rollback of the guard's own comes first) and before the
snapshot of the iteration: with the default interval, every snapshot is of replicas just found equal.
"""

import socket
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

import parallel
import training
from report import print0

KINDS = ("weights", "fp32 masters", "optimizer state")
BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}  # a float tensor's bits read as the integers of its width


@dataclass
class ReplicaCheckConfig:  # ReplicaCheck
    # -- stability: the DP replicas' check --
    # checksum the DP replicas' state every N iters (None: guard's)
    dp_replica_check_interval: int | None = None


class ReplicaCheck(training.Callback):
    """Every `interval` iterations, after the step: the DP replicas' checksums gathered and compared, a replica that
    differs re-synced (or the run rolled back, or stopped at the guard's hardware cap). Its state: the last
    iteration whose check agreed (it goes with the weights), and the faults it found per DP rank (history)."""

    Config = ReplicaCheckConfig  # its section: stability.build_callbacks builds it with it

    name = "replica_check"

    def __init__(
        self,
        replica_check_cfg,
        shared,
        spike_guard,
        snapshot_interval,
        max_hardware_faults,
        sharded,
    ):
        """spike_guard on: the default interval (snapshot_interval's: each snapshot taken right
        after a check); max_hardware_faults: a DP rank found differing this many times stops the
        run, naming it; sharded: each DP rank holds its own shard of the optimizer state
        (zero_stage >= 1, DeepSpeed's partitions), nothing to compare there."""
        self.max_hardware_faults = max_hardware_faults
        self.interval = self.asked = replica_check_cfg.dp_replica_check_interval
        if self.interval is None:  # on with the guard: each snapshot right after a check
            self.interval = (snapshot_interval or 50) if spike_guard else 0
        self.sharded = sharded
        self.guard, self.snapshots, self.writer = shared.guard, shared.snapshots, shared.writer
        # guard.Guard: saves and stops the run at the cap
        self.stopper = shared.built.get("spike_guard")
        self.last_agreed, self.faults = 0, {}

    def start(self, parts, report, train_data):
        self.parts, self.report = parts, report
        self.device = next(parallel.unwrap(parts.model).parameters()).device
        # a config of many GPUs run on one process: said, not silent
        if self.asked and parallel.grid.dp_size == 1:
            print0(
                f"replica check: dp_replica_check_interval={self.asked} compares the data-parallel replicas, "
                "and this run has one: nothing is checked"
            )

    def after_step(self, it, step):
        n = it.number
        if not self.interval or n % self.interval or parallel.grid.dp_size == 1:
            return False
        table, found = self.compare()
        if not found:
            self.last_agreed = n
            return False
        return self.act(n, table, found)

    def compare(self):
        """(the gathered checksums, the DP groups whose replicas differ: differing()), on every rank
        alike; also asked by the guard's diagnosis of a suspect step (guard.Forensics)."""
        table = gather(checksums(self.covered(), self.device))
        return table, differing(table)

    def covered(self):
        """[weights, fp32 masters, optimizer state]: this rank's tensors of each kind, in the same order on every
        replica (model order; a parameter's state in the optimizer's order). The optimizer's are left out where
        each DP rank holds a shard of its own (ZeRO-1)."""
        params = list(parallel.unwrap(self.parts.model).parameters())
        masters, state = [], []
        if not self.sharded:
            optimizer = self.parts.optimizer
            main_param = getattr(optimizer, "main_param", lambda p: p)
            for p in params:
                main = main_param(p)
                if main is not None and main is not p:
                    masters.append(main)
                state += [
                    t
                    for t in optimizer.state.get(main if main is not None else p, {}).values()
                    if torch.is_tensor(t)
                ]
        return [params, masters, state]

    def act(self, n, table, found):
        """Name the replicas that differ, count their faults; then stop at the guard's cap, roll back (no majority,
        and a snapshot at or before the last check that agreed), or re-sync. True: the run was rolled back."""
        split = any(healthy is None for healthy, _ in found.values())
        rollback = (
            split
            and self.guard.enabled
            and any(item[0] <= self.last_agreed for item in self.snapshots.items)
        )
        lines = [
            describe(n, tp, pp, healthy, ranks, table, rollback)
            for (tp, pp), (healthy, ranks) in found.items()
        ]
        for line in lines:
            print0(line)
        name_hosts(n, found)
        suspects = sorted(
            {d for healthy, ranks in found.values() if healthy is not None for d in ranks}
        ) or [None]
        worst = self.count(suspects)
        reason = "; ".join(lines)
        self.report.record(n, {"replica check": [{"iteration": n, "reason": reason}]})
        cap = self.max_hardware_faults
        if self.guard.enabled and self.guard.faults[worst] >= cap:
            self.stop(n, reason, worst, cap)
        if rollback:
            return self.roll_back(n, reason)
        self.resync(found)
        self.last_agreed = n
        return False

    def count(self, suspects):
        """Count a fault for each suspect DP rank (None: not known), in the guard's count too when it is on;
        returns the one with the most of the guard's (None: the guard is off, or the rank is not known)."""
        for d in suspects:
            self.faults[d] = self.faults.get(d, 0) + 1
            if self.guard.enabled:
                self.guard.faults[d] = self.guard.faults.get(d, 0) + 1
        return (
            max(suspects, key=lambda d: self.guard.faults.get(d, 0)) if self.guard.enabled else None
        )

    def stop(self, n, reason, rank, cap):
        """The guard's stop at its hardware cap: the last good state (the newest snapshot at or before the last
        check that agreed) saved, and the run stopped (spike_guard.SpikeGuardStop)."""
        where = "an unknown DP rank (two replicas differ)" if rank is None else f"DP rank {rank}"
        decision = {
            "iteration": n,
            "action": "stop",
            "reason": reason,
            "cause": "hardware",
            "rank": rank,
            "start": self.last_agreed + 1,
            "evidence": reason,
        }
        decision["line"] = (
            f"spike guard: iteration {n}: {self.guard.faults[rank]} faults on {where}, the "
            f"spike_guard_max_hardware_faults={cap}th: take its node out"
        )
        print0(decision["line"])
        self.stopper.carry_out(decision)

    def roll_back(self, n, reason):
        """Two replicas differ and nothing tells which is right: back to the newest snapshot of replicas found
        equal, as the guard's hardware rollback (no data skipped, the LR unchanged, no relapse counted)."""
        decision = {
            "iteration": n,
            "action": "rollback",
            "reason": reason,
            "cause": "hardware",
            "rank": None,
            "evidence": reason,
            "start": self.last_agreed + 1,
            "end": None,
            "lr_scale": self.guard.lr_scale,
            "reset_optimizer": False,
        }
        decision["line"] = (
            f"spike guard: iteration {n}: the DP replicas differ and no majority tells the healthy "
            f"one: roll back to the newest snapshot at or before iteration {self.last_agreed} (the "
            "last check that agreed); no data skipped, LR unchanged"
        )
        print0(decision["line"])
        self.report.record(n, {"spike guard": [decision]})
        if self.writer is not None:
            self.writer.wait()  # a rollback may read the checkpoint being written
        target = self.snapshots.roll_back(decision, self.parts, self.guard)
        self.last_agreed = target
        return True

    @torch.no_grad()
    def resync(self, found):
        """Every tensor checked, copied from the healthy replica (no majority: DP rank 0) over this rank's DP group,
        when its group differs."""
        g = parallel.grid
        if (g.tp_rank, g.pp_rank) not in found:
            return
        healthy, _ = found[(g.tp_rank, g.pp_rank)]
        source = g.rank_of(g.tp_rank, healthy or 0, g.pp_rank)
        for tensors in self.covered():
            for t in tensors:
                dist.broadcast(t.data, src=source, group=g.dp_group)

    def state_dict(self):
        return {"last agreed": self.last_agreed, "faults": dict(self.faults)}

    def load_state_dict(self, state, run, resume):
        """The last check that agreed goes with the weights; the faults found are history: kept by a rollback."""
        if state:
            self.last_agreed = state["last agreed"]
            if resume:
                self.faults = dict(state["faults"])


def checksums(kinds, device):
    """One int64 per kind of tensor: the sum of their bit patterns as integers (exact: the same on every rank)."""
    sums = []
    for tensors in kinds:
        total = torch.zeros((), dtype=torch.int64, device=device)
        for t in tensors:
            total += t.detach().view(BITS.get(t.dtype, t.dtype)).sum(dtype=torch.int64)
        sums.append(total)
    return torch.stack(sums)


def gather(values):
    """Every rank's checksums, [world][kind], on every rank: one all-gather on the backend's device, one host read."""
    values = values.to(parallel.comm_device())
    out = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    return torch.stack(out).tolist()


def differing(table):
    """{(TP rank, PP rank): (the DP rank whose copy is taken, or None without a majority; the DP ranks that differ
    from it)} for each DP group whose replicas differ. The same on every rank: it reads the gathered table only."""
    g, found = parallel.grid, {}
    for pp in range(g.pp_size):
        for tp in range(g.tp_size):
            rows = [tuple(table[g.rank_of(tp, d, pp)]) for d in range(g.dp_size)]
            if len(set(rows)) == 1:
                continue
            common, votes = Counter(rows).most_common(1)[0]
            healthy = rows.index(common) if 2 * votes > len(rows) else None
            reference = rows[healthy or 0]
            found[(tp, pp)] = (healthy, [d for d, row in enumerate(rows) if row != reference])
    return found


def describe(n, tp, pp, healthy, ranks, table, rollback):
    """One line: which replicas of a DP group differ, in what, and what is done."""
    g = parallel.grid
    reference = table[g.rank_of(tp, healthy or 0, pp)]
    parts = []
    for d in ranks:
        row = table[g.rank_of(tp, d, pp)]
        what = " and ".join(kind for kind, a, b in zip(KINDS, row, reference) if a != b)
        parts.append(f"DP rank {d} (global rank {g.rank_of(tp, d, pp)}) in its {what}")
    where = f" (TP rank {tp}, PP rank {pp})" if g.tp_size * g.pp_size > 1 else ""
    line = f"DP replica check: iteration {n}{where}: " + ", ".join(parts)
    if healthy is not None:
        agree = sum(1 for d in range(g.dp_size) if table[g.rank_of(tp, d, pp)] == reference)
        return (
            line
            + f" differs from the {agree} of {g.dp_size} replicas that agree: re-synced from DP rank {healthy}"
        )
    line += f" differs from DP rank {healthy or 0}: no majority tells which is right"
    return line + (
        ""
        if rollback
        else ": DP rank 0's copy taken (no snapshot of equal replicas to roll back to)"
    )


def name_hosts(n, found):
    """Each rank that differs (without a majority: each of its group) says where it runs."""
    g = parallel.grid
    healthy, ranks = found.get((g.tp_rank, g.pp_rank), (0, []))
    if g.dp_rank in ranks or (healthy is None and ranks):
        print(
            f"DP replica check: iteration {n}: DP rank {g.dp_rank} is global rank {g.rank} on host "
            f"{socket.gethostname()}",
            flush=True,
        )
