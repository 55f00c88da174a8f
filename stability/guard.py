"""The spike guard at the loop's named points: three callbacks, each its own part of docs/spike_guard.md.

    Guard       its decisions carried out: skipped iterations, the LR scale, a vetoed update, a decision after the
                step (recorded; a rollback, or saving and stopping); it measures the run's nondeterminism when it arms
    Precursor   the early rung: a telemetry precursor past its threshold cuts the LR (section 7)
    Forensics   a suspect step replayed and its weights and batch tested before the guard decides (section 2)

They share the spike guard (spike_guard.SpikeGuard: the detector's statistics, the decisions, the timeline) and
the snapshots, handed to each at construction (stability.Shared). Every rank runs them on the same numbers (the
step's are DP rank 0's on every replica: training.agree), so the ranks cannot decide apart.
"""

import math
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

import checkpoint
import loader
import parallel
import run_state
import safety
import training
from report import print0
from stability import detector, diagnosis, spike_guard, update_size

# What a stopped run's message asks of its operator, by the cause the guard found
NEXT = {
    None: "no cause was named (the decision lines above say what was tested): resume with "
    "the caps raised or other settings",
    "data": "look at the samples named above (their documents: the skip list), then resume with the caps raised",
    "optimizer": "the cause persists in the LR or the optimizer state, not in the data: resume with a lower lr "
    "(or spike_guard_reset_optimizer)",
    "hardware": "take the named rank's node out, then resume",
    "persistent": "take the named rank's node out, then resume",
}


def hosts_of(dp_rank):
    """The hosts of the processes of DP rank `dp_rank` (every TP and PP rank of it), gathered from
    every rank (a collective: called by all, as every rank decides alike); [] for an unknown rank."""
    if dp_rank is None:
        return []
    mine = (parallel.grid.dp_rank, socket.gethostname())
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return sorted({host for rank, host in everyone if rank == dp_rank})


class Guard(training.Callback):
    """The spike guard's decisions where the loop meets them. Its state is the guard's (checkpoints keep its
    decisions; a rollback restores its statistics only), and it holds whether or not the guard is on now: a
    resumed run honours the skip ranges and LR factor it finds (stability.switched_on)."""

    Config = spike_guard.GuardConfig  # the spike guard's section: what a spike calls for

    name = "spike_guard"

    def __init__(self, guard_cfg, shared, core, save_interval):
        """guard_cfg: its keys, which the spike guard (shared.guard) reads; core: the core's keys
        (stability.CoreKeys) its forwards and the samples it names read, and save; save_interval: the
        disk checkpoints' cadence, the update size's without snapshots."""
        self.core = core
        self.guard, self.snapshots, self.writer = shared.guard, shared.snapshots, shared.writer
        self.built = shared.built  # the replica check, built after: it carries out its own findings
        # the update size's readings: at each snapshot, or without snapshots at each disk checkpoint
        self.reading_interval = self.snapshots.interval or (
            (save_interval or 0) if core.save else 0
        )
        # without snapshots: (iteration, updates, weights, stride) of the last checkpoint
        self.sampled = None

    def start(self, parts, report, train_data):
        self.parts, self.report, self.train_data = parts, report, train_data
        self.device = next(parallel.unwrap(parts.model).parameters()).device
        # a longer run's warm-up kept in a config: the detector would judge nothing, in silence
        held = len(self.guard.series["loss"].values)
        left = parts.schedule.total_iters - parts.state.iteration
        needed = self.guard.rules.spike_guard_min_steps
        if self.guard.enabled and held + left < needed:
            print0(
                f"warning: spike_guard_min_steps {needed}: this run's {left} iterations after the {held} steps its "
                "detector holds do not reach it: the spike guard's detector judges no step of this run"
            )
        # resumed: the checkpoint resumed from is the first reading's reference
        if parts.state.iteration:
            self.sample(parts.state.iteration)

    def sample(self, iteration):
        """Without snapshots: a sampled copy of the weights of now, the state of the disk checkpoint of
        `iteration` (update_size.sample), the next reading's reference."""
        guard = self.guard
        if self.snapshots.interval or not (
            guard.enabled and guard.rules.spike_guard_update_ratio and self.reading_interval
        ):
            return
        self.sampled = (iteration, guard.updates, *update_size.sample(self.parts.model))

    def after_iteration(self, iteration):
        if self.reading_interval and iteration % self.reading_interval == 0:
            self.sample(iteration)  # saved by now: the checkpoint's state

    def skip(self, iteration):
        return "spike guard" if self.guard.skips(iteration) else None

    def before_step(self, it):
        guard = self.guard
        it.lr = it.lr * guard.lr_scale
        # the tolerance of a replay (diagnosis.reproduced_tolerance)
        if guard.noise is None and guard.armed():
            guard.noise = diagnosis.measure_noise(
                self.parts.model, it.batches, self.core, self.device
            )
        interval = guard.rules.spike_guard_unseen_interval
        if guard.armed() and interval and it.number % interval == 0:
            guard.unseen = self.unseen_loss(it)

    def unseen_loss(self, it):
        """The loss of a batch never trained on (comparison(): a held-out one) on the weights of
        now: where the model really is, which a loss learnt by heart falls far below
        (Detector.below_unseen). One forward every spike_guard_unseen_interval iterations, the RNG
        streams put back (the run is the one without the guard); the last one kept past the end of
        the data."""
        found = comparison(self.train_data, it, self.built.get("faults"), self.core, self.device)
        if found is None:
            return self.guard.unseen
        batches, _ = found
        rng = checkpoint.rng_state()
        loss = diagnosis.evaluate_batches(self.parts.model, batches, self.core, self.device)
        checkpoint.set_rng_state(rng)
        # a forward that overflowed tells nothing of the data
        return loss if math.isfinite(loss) else None

    def update_factor(self, loss, grad_norm):
        return 0.0 if self.guard.armed() and self.guard.judge(loss, grad_norm) else 1.0

    def after_step(self, it, step):
        guard, n = self.guard, it.number
        # what Forensics found about this step, if it was suspect
        found, guard.diagnosis = guard.diagnosis, None
        if (found or {}).get("replicas"):  # the replica check's finding: its re-sync or rollback
            guard.last_run, guard.pending = max(guard.last_run, n), None
            return self.built["replica_check"].act(n, *found["replicas"])
        # how far the LR is off: the move since the snapshot
        if (
            (found or {}).get("cause") == "optimizer"
            and found.get("since") is not None
            and guard.rules.spike_guard_update_ratio
        ):
            found["update_size"] = self.move_since(found["since"])
        decision = guard.update(
            n, step.outcome, step.loss, step.grad_norm, self.parts.scaler, found, lr=it.lr
        )
        if decision is None:
            decision = self.update_size(n, step)
        elif decision.get("cause") == "data" and not decision.get("rebased"):  # name the batch
            # (not a regime change's, an optimizer's or an undiagnosed one's: ordinary samples)
            decision["samples"] = diagnosis.name_samples(
                self.parts.model,
                it.batches,
                it.first_sample,
                self.core,
                self.train_data,
                it.seqlen,
                n,
                decision,
            )
        if decision is None:
            return False
        self.report.record(n, {"spike guard": [decision]})
        if decision["action"] not in ("rollback", "stop"):
            return False
        return self.carry_out(decision)

    def update_size(self, n, step):
        """At each snapshot iteration, an applied step: the weights' move per update since the newest snapshot
        (update_size.py), judged against its trend (Detector.moved) and recorded; an outlier is the optimizer's
        doing (SpikeGuard.moved_too_far) -- unless a weight moved farther than the optimizer can move
        it, a corruption that the hardware diagnosis and the replica check answer, not this rule. Without
        snapshots, at each disk checkpoint: the move since the one before read from a sampled copy (sample()),
        and only an outlier read again against that checkpoint itself, which decides. The decision, or None."""
        guard, interval = self.guard, self.reading_interval
        if not (
            guard.enabled
            and guard.rules.spike_guard_update_ratio
            and interval
            and n % interval == 0
            and step.outcome == "ok"
        ):
            return None
        where = "at the snapshot" if self.snapshots.interval else "at the checkpoint"
        if not self.snapshots.interval:
            if self.sampled is None or self.sampled[0] >= n or guard.updates <= self.sampled[1]:
                return None
            then, updates, weights, stride = self.sampled
            move = update_size.relative_move(
                self.parts.model, weights, guard.updates - updates, stride
            )
            if not (guard.armed() and guard.moved(move)):
                guard.series["update"].record(move)
                return None
            if self.writer is not None:
                self.writer.wait()  # the checkpoint read next may be the one being written
        found = self.snapshots.newest_before(n)  # after a resume, the checkpoint resumed from
        move = None if found is None else self.move_since(found[0], found)
        if move is None:
            return None
        then, payload = found
        reason = guard.moved(move) if guard.armed() else None
        if reason is None:
            guard.series["update"].record(move)
            return None
        if (
            diagnosis.corrupted_weights(
                guard, self.parts.model, self.parts.optimizer, n, then, payload, say=False
            )
            is not None
        ):
            return None
        return guard.moved_too_far(n, f"{where}: {reason}", move, then)

    def move_since(self, then, found=None):
        """The weights' move per update since the state of iteration `then` (found: it, already read), or None
        without that state or any update since (update_size.relative_move)."""
        found = found or self.snapshots.newest_before(then + 1)
        if found is None or found[0] != then:
            return None
        stats = detector.snapshot_stats(found[1])
        updates = self.guard.updates - stats["updates"] if "updates" in stats else None
        if not updates or updates <= 0:
            return None
        return update_size.relative_move(self.parts.model, found[1][0], updates)

    def carry_out(self, decision):
        """A rollback (True), or, at a cap or with nothing to roll back to, the last good state saved and the run
        stopped (SpikeGuardStop)."""
        if self.writer is not None:
            self.writer.wait()  # a rollback may read the checkpoint being written
        restored = self.snapshots.roll_back(decision, self.parts, self.guard)
        if restored is not None:
            self.sample(restored)  # without snapshots: the checkpoint rolled back to
        if restored is None or decision["action"] == "stop":
            iteration = self.parts.state.iteration
            if self.core.save:
                run_state.save(self.parts, self.writer)
                saved = f"the state of iteration {iteration} saved in {self.core.save}"
            else:  # a stop says what there is to resume from: here, nothing
                saved = f"nothing saved (save=none: the state of iteration {iteration} is lost)"
            cause = decision.get("cause")
            then = NEXT.get(cause, NEXT[None])
            message = f"{decision['line']}; {saved}: {then}"
            if self.core.save:
                # a collective: every rank decided this stop
                hosts = (
                    hosts_of(decision.get("rank")) if cause in ("hardware", "persistent") else []
                )
                if self.writer is not None:
                    self.writer.wait()  # the record names a state on disk
                if parallel.grid.rank == 0:
                    safety.write_stopped(
                        self.core.save,
                        {
                            "iteration": iteration,
                            "decided_at": decision["iteration"],
                            "cause": cause,
                            "dp_rank": decision.get("rank"),
                            "hosts": hosts,
                            "exit_code": spike_guard.EXIT_CODE,
                            "next": then,
                            "message": message,
                            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        },
                    )
            self.report.close()
            self.snapshots.close()
            raise spike_guard.SpikeGuardStop(message)
        return True

    def state_dict(self):
        return self.guard.state_dict()

    def load_state_dict(self, state, run, resume):
        """At a resume, the guard's whole state; at a rollback, its statistics only (they go with the weights; its
        decisions are history). Without statistics of its own (a checkpoint of a run without the guard), the run
        state's (run_state.RunState) history of applied steps stands in for them."""
        if resume and state:
            self.guard.load_state_dict(state)
        self.guard.load_stats(
            detector.run_stats({"callbacks": {self.name: state}, "history": run.history})
        )


@dataclass
class PrecursorConfig:  # Precursor, spike_guard.precursor_rung
    # -- stability: the spike guard's precursor and forensics --
    # EXPERIMENTAL early rung (None: off): cut the LR when this passes ...
    spike_guard_precursor: str | None = None
    # ... this threshold (docs/spike_guard.md, section 7)
    spike_guard_precursor_threshold: float | None = None
    # ... by this factor, once per crossing (precursors.PRECURSORS)
    spike_guard_precursor_lr_factor: float = 0.5

    SWITCHED = {  # sections.py
        "spike_guard_precursor": (
            "spike_guard_precursor_threshold",
            "spike_guard_precursor_lr_factor",
        )
    }


class Precursor(training.Callback):
    """The early rung (spike_guard_precursor): this iteration's telemetry record, when there is one, against its
    threshold (spike_guard.precursor_rung); the cut goes into the guard's LR scale, the decision into its log."""

    Config = PrecursorConfig  # its section: stability.build_callbacks builds it with it

    name = "precursor"

    def __init__(self, precursor_cfg, shared, adam_eps):  # adam_eps: the optimizer's epsilon
        self.settings, self.adam_eps = precursor_cfg, adam_eps
        # config.check: telemetry is on
        self.guard, self.telemetry = shared.guard, shared.built["telemetry"]

    def start(self, parts, report, train_data):
        self.report = report

    def check_step(self, it, step):
        if self.telemetry.record is not None:
            warning = spike_guard.precursor_rung(
                self.guard, self.settings, self.adam_eps, it.number, self.telemetry.record
            )
            if warning is not None:
                self.report.record(it.number, {"spike guard": [warning]})
        return step


@dataclass
class ForensicsConfig:  # Forensics
    # -- stability --
    # fp16/bf16: replay a reproduced spike in fp32 (an fp32 copy of the weights)
    spike_guard_fp32_replay: bool = True

    SWITCHED = {"spike_guard": ("spike_guard_fp32_replay",)}  # sections.py


class Forensics(training.Callback):
    """A suspect step investigated before the guard decides (diagnosis.investigate): replayed, its weights and
    batch tested; the step that stands is returned and the diagnosis left on the guard (SpikeGuard.diagnosis) for
    its decision after the step. Stateless: the counterfactual's batch is a held-out one (comparison()), found
    from the iteration itself."""

    Config = ForensicsConfig  # its section: stability.build_callbacks builds it with it

    name = "forensics"

    def __init__(self, forensics_cfg, shared, core):
        """core: the core's keys (stability.CoreKeys) its forwards, the samples it names and the
        comparison batch read (its replays take the step's rules, parts.rules)."""
        self.core = core
        self.guard, self.snapshots, self.built = shared.guard, shared.snapshots, shared.built
        self.fp32_replay = forensics_cfg.spike_guard_fp32_replay and (core.fp16 or core.bf16)

    def start(self, parts, report, train_data):
        self.parts, self.train_data = parts, train_data
        self.device = next(parallel.unwrap(parts.model).parameters()).device

    def before_step(self, it):
        # where a replay starts from
        self.before = (checkpoint.rng_state(), self.parts.scaler.state_dict())

    def check_step(self, it, step):
        guard, scaler = self.guard, self.parts.scaler
        if not guard.enabled or not diagnosis.suspect(step, scaler):
            return step
        if guard.stands_aside(it.number, step):  # a persistent fp16 overflow: the scaler's
            return step
        # another callback's veto: not the guard's spike
        if step.outcome == "vetoed" and not self.guard.pending:
            return step
        if self.replicas_differ():  # a replay on replicas that differ tells nothing of the step
            return step
        parts, core = self.parts, self.core

        def rerun(judge, scaler=parts.scaler):
            return training.whole_step(
                parts.model,
                parts.optimizer,
                scaler,
                it.batches,
                it.lr,
                parts.rules,
                self.device,
                count_zeros=False,
                callbacks=diagnosis.Veto(judge),
            )

        def per_sample():
            return diagnosis.sample_losses(parts.model, it.batches, core).tolist()

        # by the guard's judge (a NaN step or replicas that differ are not)
        vetoed = step.outcome == "vetoed"
        step, self.guard.diagnosis = diagnosis.investigate(
            self.guard,
            parts,
            step,
            it.number,
            self.before,
            self.snapshots,
            rerun=rerun,
            forward=lambda: diagnosis.evaluate_batches(parts.model, it.batches, core, self.device),
            other=lambda: self.counterfactual(it),
            per_sample=per_sample if parallel.grid.pp_size == 1 else None,
            fp32_replay=self.fp32_replay,
        )
        # clip_grad bounds it, or nothing older can help: the step applied after all
        if vetoed and self.guard.lets_through(self.guard.diagnosis):
            checkpoint.set_rng_state(self.before[0])
            parts.scaler.load_state_dict(self.before[1])
            step = rerun(None)
            # SpikeGuard.update reads "unrepairable" first; "tolerated" is tolerates()'s case alone
            self.guard.diagnosis["tolerated"] = not self.guard.diagnosis.get("unrepairable")
        return step

    def replicas_differ(self):
        """DP > 1, with the DP replica check on: the replicas' checksums compared first
        (replica_check.py), the diagnosis's first question -- a replica that differs is a hardware
        fault, answered by a re-sync or a rollback to replicas found equal, never by skipping data.
        Its finding is left on the guard (diagnosis "replicas") for Guard.after_step to carry out.
        True when they differ."""
        check = self.built.get("replica_check")
        if parallel.grid.dp_size == 1 or check is None or not check.interval:
            return False
        table, found = check.compare()
        if found:
            self.guard.diagnosis = {"cause": "hardware", "replicas": (table, found)}
        return bool(found)

    def counterfactual(self, it):
        """A batch these weights have never been trained on (comparison(): a held-out one; a
        resumed run or a replay asks the same one), on the weights of now, computed and not applied
        (the same RNG and loss scaler after as before): (Step, its words, its forward for other
        weights), or None past the end of the data."""
        parts, core = self.parts, self.core
        found = comparison(self.train_data, it, self.built.get("faults"), core, self.device)
        if found is None:
            return None
        batches, label = found
        rng, scaler = checkpoint.rng_state(), parts.scaler.state_dict()
        step = training.whole_step(
            parts.model,
            parts.optimizer,
            parts.scaler,
            batches,
            it.lr,
            parts.rules,
            self.device,
            count_zeros=False,
            callbacks=diagnosis.Veto(lambda *numbers: "never applied"),
        )
        checkpoint.set_rng_state(rng)
        parts.scaler.load_state_dict(scaler)

        def forward():
            return diagnosis.evaluate_batches(parts.model, batches, core, self.device)

        return step, label, forward


HELD_OUT = 8  # the comparison batches: the training data's last global batches, in turn


def comparison(train_data, it, faults, core, device):
    """(micro-batches, their words) of a batch the weights were never trained on, for the unseen
    loss and the counterfactual, or None past the end of the data: one of the last HELD_OUT global
    batches of the training data's order, in turn -- reached at the run's end if at all, far from
    where it is now. It was the next iteration's batch, which comes from the stretch under
    suspicion: a block of duplicates met in corpus order gave its own next batch as the "unseen"
    one, so the block looked like the norm, the trend was re-based to it and ordinary text after it
    was named on the skip list (issue #50). Within HELD_OUT batches of the end: the next batch. The
    data's faults are in it, as in the corpus (Faults.data_batches)."""
    size = it.batch_size
    first = (len(train_data) // size - HELD_OUT + it.number % HELD_OUT) * size
    first = max(first, it.first_sample + size)  # never a batch an applied step has seen
    if first + size > len(train_data):
        return None
    number = it.number + (first - it.first_sample) // size  # the iteration that will draw it
    batches = loader.micro_batches(
        train_data, first, len(it.batches), core.micro_batch_size, it.seqlen, device
    )
    if faults is not None:
        batches = faults.data_batches(number, first, size, it.seqlen, batches)
    return batches, f"iteration {number}'s batch (unseen)"
