"""The spike guard: the chronicles' firefighting done by the run itself (lessons 8, 9, 21), after a diagnosis.

The tr8b-104B team watched the loss, rolled back to a checkpoint, skipped a window of data with
skip_train_iteration_range, lowered the LR or reset the optimizer, and relaunched -- by hand, for days. PaLM wrote
the recipe down (restart ~100 steps before the spike, skip 200-500 batches); OLMo-core automated its first rung.
But the causes call for different remedies, so the guard asks why before it acts (docs/spike_guard.md):

  detect     a step's loss is more than `spike_guard_zscore` scatters above the line fitted to the last 16
             applied losses and above `spike_guard_ema_ratio` x that line's value (the scatter: the line's past
             prediction errors, Series); or its grad norm (its logarithm) the same and above
             `spike_guard_grad_norm_ratio` x; or the loss half as far off its line, above or below (a
             degenerate batch the model finds easy), with an outlying grad norm, or a whole bar below with
             the grad norm half as far up; or `spike_guard_rise_steps` losses in a row each half as far
             above (a slow rise the line follows);
             or the loss far below an unseen batch's on the same weights, a stretch of steps (text learnt by
             heart); or, at a snapshot, the weights' move per update far above its trend (update_size.py);
             or the loss is NaN/inf; or the DP replicas computed different numbers; or (fp16) the loss scale
             collapsed to min_loss_scale. From `spike_guard_min_steps` applied steps on (in fp16 the losses of
             the loss scale's search count): the trend makes the warm-up ordinary.
  diagnose   (investigate(), before any update or action: every spike, NaN loss, replica
             disagreement and non-finite grad norm no loss scaler answers; on DP > 1 the replica
             check's checksums first, whose finding is the replica check's to answer: re-sync or
             roll back, no data skipped)
             replay the step, same weights, batch and RNG:
               the same DP rank disagrees again                -> persistent: stop, naming the rank
               not reproduced (beyond the run's measured nondeterminism), or the replicas disagreed
                                                               -> hardware: the replayed step is applied (a retry)
               reproduced:
                 a weight moved farther since the newest snapshot two updates back than the optimizer can
                 move it (its step_bound)
                                                           -> hardware: roll back to it, no data skipped, no LR cut
                 fp16/bf16: the step replayed in fp32 (TF32 off) is ordinary
                                                           -> numerical: the fp32 step applied (fp16: the loss scale
                                                              halved once per episode, never to its floor);
                                                              spike_guard_max_numerical in a window: persistent,
                                                              each step's fp32 step still applied, never a stop
                                                              -- an fp16 overflow's: the scaler's
                 counterfactual: a batch never trained on (the next one) on these weights (computed, never applied)
                   ordinary, or this batch far below it        -> data: this batch is the cause (either sign); a
                                                                  minority of its samples, if far off, is named
                   off its trend too, as far on the oldest snapshot's weights
                                                               -> data, a regime change: the trend re-based
                   off its trend too, worse than on the oldest snapshot's weights
                                                               -> optimizer: roll back at once, skip no data, and
                                                                  cut the LR unless the LRs since the snapshot
                                                                  were not the schedule's: no rollback replays;
                                                                  again after a rollback: named persistent
                   off its trend too, no snapshot yet (none two updates back: nothing older to test or roll
                   back to)                                    -> optimizer, unrepairable: no action, the step
                                                                  applied as without the guard, the trend re-based
             Every decision line says which test removed the spike, with its numbers.
             The weights' move per update far above its trend (a snapshot's reading, no replay)
                                                           -> optimizer: roll back to the snapshot it was measured
                                                              from, skip no data, the LR x trend / move (a replay
                                                              would meet the same LRs) or unchanged (fault injection)
             The spike_guard_max_hardware_faults-th hardware fault on one DP rank stops the run, naming it.
  act (data) (0) a spike of the grad norm alone (the loss ordinary) with clip_grad on: no action, the update
                 applied, as clip_grad bounds it (tolerates(): the campaigns' only such data spikes were in clean runs);
             (a) skip the update: no weight, Adam moment, step counter or LR-schedule change;
             (b) text learnt by heart (a batch far below a held-out one: the stretch before it taught it), at the
                 `spike_guard_max_skips`-th such spike within `spike_guard_rewind` iterations: roll back to the
                 newest snapshot (host copy, or disk checkpoint) before the stretch -- from `spike_guard_rewind`
                 before the first spike to this one -- and add it to the run's skip ranges; once rolled back, the
                 stretch's later batches are skipped as they come. A rollback never skips more than that: an
                 outlier batch's update is skipped, and a rollback over outliers alone would replay the same
                 updates (theirs withheld), so none is taken; no batch after the spike is skipped ahead;
             Undiagnosed (no run has such a step), a spike is an update not applied, nothing more.
             (c) on an optimizer relapse (not the data's, not undiagnosed): also multiply the LR by
                 `spike_guard_lr_factor` and, with `spike_guard_reset_optimizer`, reset the optimizer with the
                 lr=0 warm-up of lesson 8.
             A rollback whose target lies before every state kept goes to the oldest state there is
             (snapshots.py); with none, the run stops saying why. Rollbacks and skipped iterations are capped; at a
             cap the run saves its last good state and exits with code 3 and a message naming the cause.
  explain    every decision is one `spike guard: ...` line with its cause and evidence, a record in metrics.jsonl
             and an entry in the run state of the checkpoint; a resumed run honours the skip ranges and the LR
             factor and never decides again. The highest-loss samples of a spiking batch are named and decoded,
             and a data spike's documents appended to the skip list (skip_list.py).
  warn       (precursor_rung(), off by default) a telemetry precursor past its threshold cuts the LR once, before
             any spike (docs/spike_guard.md, section 7).

The detection is detector.py's (this class builds on its Detector), the diagnosis diagnosis.py's; this file holds
the decisions and the caps. The points of the loop where each part acts are the callbacks of guard.py.

The guard's state has two parts. Its statistics (the recent losses and grad norms) belong to the weights and are
rolled back with them; its decisions (skip ranges, LR factor, counters, faults per rank, the decision log) are
history and never are. Every replica decides from DP rank 0's numbers (training.agree), so replicas cannot split.

Fault injection (faults.py) makes spikes on purpose; an injected LR spike or bit flip is an event in time, and
the guard keeps the run's timeline that says whether a pass meets it (meets_fault) and whether a rollback would
replay the same LRs (note_lr, replays_same_lrs).
"""

import math
import socket
from dataclasses import dataclass

import parallel
import schedule
import training
from report import print0
from stability import precursors
from stability.detector import LEARNT, Detector

EXIT_CODE = 3


@dataclass
class GuardConfig:  # SpikeGuard: what a spike calls for
    # -- stability: the spike guard (lesson 21) --
    # skip a spiking step; a stretch learnt by heart: roll back over it; on a relapse lower the LR
    spike_guard: bool = False
    # spikes of text learnt by heart within spike_guard_rewind iterations before a rollback
    spike_guard_max_skips: int = 3
    # that rollback goes back to before (first spike - this) and skips the stretch from there to now
    spike_guard_rewind: int = 100
    # on a relapse (a second rollback), multiply the LR by this from then on
    spike_guard_lr_factor: float = 0.5
    # on a relapse, also reset the optimizer with the lr=0 warm-up (lesson 8)
    spike_guard_reset_optimizer: bool = False
    # more would be needed: save the last good state and exit (code 3)
    spike_guard_max_rollbacks: int = 3
    # iterations skipped by the guard in all, then save and exit (code 3)
    spike_guard_max_skipped_iters: int = 2000
    # transient faults on one DP rank before the run stops, naming it
    spike_guard_max_hardware_faults: int = 3
    # numerical diagnoses in spike_guard_rewind iterations: a persistent fault (named; an fp16
    # overflow's later steps are left to the loss scaler)
    spike_guard_max_numerical: int = 4

    # keys read only while a switch is on (sections.py): the decisions' (max_hardware_faults is the replica check's
    # too); the detector's are detector.DetectorConfig's
    SWITCHED = {
        "spike_guard": (
            "spike_guard_max_skips",
            "spike_guard_rewind",
            "spike_guard_lr_factor",
            "spike_guard_reset_optimizer",
            "spike_guard_max_rollbacks",
            "spike_guard_max_skipped_iters",
            "spike_guard_max_numerical",
        )
    }


class SpikeGuardStop(training.StopRun):
    """A cap was reached: the run saved its last good state and stops (train.py exits with EXIT_CODE)."""

    exit_code = EXIT_CODE


class SpikeGuard(Detector):
    """The detector's statistics and rules (detector.Detector), and the decisions taken from them."""

    Config = GuardConfig  # its section: stability.build_callbacks builds it with it

    def __init__(
        self, detector_cfg, guard_cfg, clip_grad, snapshot_interval, step_bound, saved=None
    ):
        """detector_cfg, guard_cfg: its sections; clip_grad: the core's (Detector, tolerates());
        snapshot_interval: spike_guard_snapshot_interval, how far back the LRs a rollback would
        replay are kept; step_bound: the most one step of the run's optimizer moves a weight, in
        units of its LR (optim.step_bound; None: unknown, no weight is judged corrupted)."""
        super().__init__(detector_cfg, clip_grad)
        self.ladder, self.snapshot_interval = guard_cfg, snapshot_interval
        self.step_bound = step_bound
        self.enabled = self.ladder.spike_guard
        # decisions: never rolled back
        self.strikes = []  # iterations of the learnt-by-heart spikes of the current episode
        self.skip_ranges = []  # [start, end] inclusive, added by rollbacks
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped_iters = 0
        self.decisions = []
        self.faults = {}  # DP rank (None: unknown) -> transient faults seen on it
        self.last_run = 0  # the highest iteration run (fault injection happens once in time)
        # the run's own nondeterminism: relative difference of a forward and its repeat
        self.noise = None
        # the current step: why it is a spike (judge -> update), what the forensics found (-> update)
        self.pending = self.diagnosis = None
        # iterations of the numerical diagnoses of the current window (persistence)
        self.numericals = []
        self.aside = False  # a persistent fp16 overflow left to the loss scaler (stands_aside)
        # iteration -> (the LR its replay would get, the LR applied), where they differ
        self.lrs = {}
        if saved:
            self.load_state_dict(saved)

    # -- state -----------------------------------------------------------------------------------------------

    def state_dict(self):
        return {
            "stats": self.stats(),
            "strikes": list(self.strikes),
            "skip_ranges": [list(r) for r in self.skip_ranges],
            "lr_scale": self.lr_scale,
            "rollbacks": self.rollbacks,
            "skipped_iters": self.skipped_iters,
            "decisions": list(self.decisions),
            "faults": dict(self.faults),
            "last_run": self.last_run,
            "noise": self.noise,
        }

    def load_state_dict(self, sd):
        self.load_stats(sd["stats"])
        self.strikes = list(sd["strikes"])
        self.skip_ranges = [tuple(r) for r in sd["skip_ranges"]]
        self.lr_scale, self.rollbacks, self.skipped_iters = (
            sd["lr_scale"],
            sd["rollbacks"],
            sd["skipped_iters"],
        )
        self.decisions = list(sd["decisions"])
        self.faults, self.last_run = dict(sd.get("faults", {})), sd.get("last_run", 0)
        self.noise = sd.get("noise")

    # -- what the training loop asks -------------------------------------------------------------------------

    def skips(self, iteration):
        return schedule.in_ranges(iteration, self.skip_ranges)

    def armed(self):
        """The guard judges when it is on and its detector has its steps (Detector.ready)."""
        return self.enabled and self.ready()

    def judge(self, loss, grad_norm):
        """Before the update (the step's update_factor): why this step is a spike, or None."""
        self.pending = super().judge(loss, grad_norm)
        return self.pending

    # -- the run's timeline: what fault injection strikes ----------------------------------------------------

    def meets_fault(self, iteration, ranges):
        """Does fault injection strike this iteration? An injected LR spike or bit flip is an event in time:
        it strikes the first pass through its iterations, and a rollback decided after it began ends it (the
        iterations run again, and the rest of its range, do not meet it). A bad batch is data: it comes back."""
        for start, end in ranges:
            if schedule.in_ranges(iteration, [(start, end)]):
                rolled_back = any(
                    d["action"] == "rollback" and d["iteration"] >= start for d in self.decisions
                )
                return iteration > self.last_run and not rolled_back
        return False

    def note_lr(self, iteration, replayed, applied):
        """An iteration's LR (applied) that a replay would not get (replayed): fault injection's event in time.
        Kept as far back as a rollback can reach."""
        reach = 2 * max(self.snapshot_interval, 1)
        self.lrs = {n: lrs for n, lrs in self.lrs.items() if iteration - n <= reach}
        self.lrs[iteration] = (replayed, applied)

    def replays_same_lrs(self, since, iteration):
        """Would a rollback to the snapshot of iteration `since` apply the same LRs as the run did since? Only
        fault injection makes a pass's LR differ from its replay's (an event in time); else, with the data and
        the RNG streams restored, the run would replay the spike bit for bit."""
        return all(
            expected == applied
            for n, (expected, applied) in self.lrs.items()
            if since < n <= iteration
        )

    # -- the decision ----------------------------------------------------------------------------------------

    def update(self, iteration, outcome, loss, grad_norm, scaler, diagnosis=None, lr=0.0):
        """After train_step (and investigate()): record an applied step (at learning rate lr), or decide what a
        spike calls for, from its diagnosis. Returns the decision (a dict: action skip | retry | rollback | stop,
        with its reason, cause, evidence and line) or None."""
        self.last_run = max(self.last_run, iteration)
        cause = (diagnosis or {}).get("cause")
        if diagnosis is None and self.stands_aside(iteration, outcome, grad_norm):
            self.numericals.append(iteration)  # one more step of the overflow: the episode goes on
            return None
        if cause == "hardware":
            return self._hardware(iteration, outcome, loss, grad_norm, lr, diagnosis)
        if cause == "numerical":
            return self._numerical(iteration, loss, grad_norm, lr, scaler, diagnosis)
        if cause == "persistent":  # a retry on that rank cannot help
            return self._decide(
                iteration,
                "stop",
                f"persistent fault on DP rank {diagnosis['rank']}: {diagnosis['evidence']}",
                "the same rank disagrees on replay: take its node out",
                cause="persistent",
                evidence=diagnosis["evidence"],
                rank=diagnosis["rank"],
                start=iteration - 1,
            )
        if (diagnosis or {}).get("unrepairable"):
            return self._unrepairable(iteration, outcome, loss, grad_norm, lr, diagnosis)
        if outcome == "ok" and (diagnosis or {}).get("tolerated"):
            return self._tolerated(iteration, loss, grad_norm, lr, diagnosis)
        if outcome == "ok":
            self.record(loss, grad_norm, lr)
            return None
        if not self.enabled or self._loss_scale_search(outcome, loss, grad_norm, scaler):
            return None
        reason = self._spike(outcome, loss, grad_norm, scaler)
        if reason is None:
            return None
        self.pending = None
        return self._strike(iteration, outcome, reason, diagnosis)

    def stands_aside(self, iteration, step_or_outcome, grad_norm=None):
        """Is this step one more of a persistent fp16 overflow left to the loss scaler (_numerical):
        a non-finite grad norm within spike_guard_rewind of the last one? Then it is neither
        diagnosed nor acted on: the core skips it, as without the guard."""
        outcome = getattr(step_or_outcome, "outcome", step_or_outcome)
        grad_norm = getattr(step_or_outcome, "grad_norm", grad_norm)
        return (
            self.aside
            and outcome == "skipped"
            and not math.isfinite(grad_norm)
            and bool(self.numericals)
            and iteration - self.numericals[-1] <= self.ladder.spike_guard_rewind
        )

    def tolerates(self, diagnosis):
        """Is this spike one to let through: its grad norm alone an outlier (the loss ordinary: Detector.judge), the
        diagnosis data (replayed and reproduced, the weights sound, not a half-precision fault, a batch never trained
        on ordinary on these weights), and clip_grad on? clip_grad already bounds its update, so skipping it
        protects nothing, and the records show no harmful fault seen only that way: the fourth and fifth campaigns'
        three such decisions were all in clean runs, each a false positive (a 4x128 model's iteration 20, grad norm
        131x and 821x its trend), while the faults whose grad norm alone spiked -- a gradient bit flip, a cancellation
        in half precision -- were diagnosed hardware or numerical, which this leaves as they were (docs/spike_guard.md,
        section 9: "Designed for the sixth campaign"; lab/design_sixth.py)."""
        return (
            bool(self.clip_grad)
            and self.grad_norm_alone
            and (diagnosis or {}).get("cause") == "data"
            and not diagnosis.get("rebase")
        )

    def lets_through(self, diagnosis):
        """Is this spike's step to be applied after all (Forensics runs it again, unvetoed): one
        tolerates() lets through, or one no remedy can help (diagnosis "unrepairable")?"""
        return self.tolerates(diagnosis) or bool((diagnosis or {}).get("unrepairable"))

    def _unrepairable(self, iteration, outcome, loss, grad_norm, lr, diagnosis):
        """A spike of the weights with nothing older to roll back to (diagnosis.without_snapshot): the
        step applied by Forensics as the core applies it without the guard, the trend re-based to the
        unseen batch's numbers (when finite) so that the next steps are judged against where the
        weights are, no decision, one line. Skipping its update would leave the same weights to spike
        on the next batch: doing nothing is the best there is."""
        trend = diagnosis.get("trend")
        if trend is not None:
            self.rebase(*trend)
        if outcome == "ok":
            self.record(loss, grad_norm, lr)
        based = (
            ""
            if trend is None
            else f", the trend re-based to loss {trend[0]:.4g}, grad norm {trend[1]:.4g}"
        )
        print0(
            f"spike guard (no action): iteration {iteration}: {self.pending}; optimizer-driven: "
            f"{diagnosis['evidence']}: the step applied as without the guard{based}"
        )
        self.pending = None
        return None

    def _tolerated(self, iteration, loss, grad_norm, lr, diagnosis):
        """A spike tolerates() let through, its update applied (clipped) by Forensics: no decision, no strike, one
        line. Its grad norm is recorded as the trend's own value, so that one outlier neither tilts the line nor
        widens the scatter the next steps are judged by."""
        expected = self.series["grad norm"].expected()
        self.record(loss, grad_norm if expected is None else expected, lr)
        print0(
            f"spike guard (no action): iteration {iteration}: {self.pending}; data-driven: {diagnosis['evidence']}: "
            f"the update applied, clip_grad={self.clip_grad:g} bounds it"
        )
        self.pending = None
        return None

    def _loss_scale_search(self, outcome, loss, grad_norm, scaler):
        """An fp16 overflow while the loss scale searches: the loss is the weights' (no update was made), so the
        guard arms on it even while the scale searches; a fault early in fp16 is judged, not learnt as the trend."""
        if (
            outcome == "skipped"
            and scaler is not None
            and scaler.dynamic
            and math.isfinite(loss)
            and not math.isfinite(grad_norm)
            and scaler.scale > scaler.min_scale
        ):
            self.series["loss"].record(loss)
            return True
        return False

    def _spike(self, outcome, loss, grad_norm, scaler):
        """Why this step that applied no update is a spike, or None."""
        # by the guard's judge (pending), or by another callback: not a spike of its own
        if outcome == "vetoed":
            return self.pending or None
        if outcome == "nan":
            return f"the loss is {loss}"
        if outcome == "skipped" and not math.isfinite(grad_norm):
            if not scaler.dynamic:
                return f"the grad norm is {grad_norm}"
            # an fp16 overflow is the loss scaler's business, until the scale has collapsed
            if scaler.scale <= scaler.min_scale:
                return f"the fp16 loss scale collapsed to {scaler.scale}"
            return None
        return None  # skip_grad_norm_above: OPT's rule, not a spike

    def _strike(self, iteration, outcome, reason, diagnosis):
        """A spike, with its diagnosis (guard.Forensics gives every suspect step one): skip its
        update, or at the spike_guard_max_skips-th data spike of an episode (or an optimizer cause)
        roll back. Without a diagnosis, nothing beyond the update not applied: a non-finite step, an
        overflow or a collapsed loss scale acted on undiagnosed rolled back over hundreds of good
        batches and cut the LR (issue #50's fp16 overflow burst: 216 of 400 iterations skipped, 0.10
        worse than doing nothing). A data spike whose unseen batch was as far off on the pre-spike
        weights is a regime change: the trend is re-based and the episode's strikes cleared."""
        ladder = self.ladder
        cause = self._cause_of(diagnosis)
        # the weights are already damaged: skipping updates cannot help
        if cause.get("cause") == "optimizer":
            return self._optimizer_strike(iteration, reason, cause, diagnosis)
        if diagnosis:
            reason += f"; {diagnosis['cause']}-driven: {diagnosis['evidence']}"
        if diagnosis and diagnosis.get("rebase"):
            return self._rebase(iteration, outcome, reason, cause, *diagnosis["rebase"])
        learnt = LEARNT in reason
        if not diagnosis:  # never acted on undiagnosed: the update not applied, no strike counted
            reason += "; not diagnosed"
        elif learnt:  # the strikes of a stretch learnt by heart, the one data rollback's
            recent = [s for s in self.strikes if iteration - s <= ladder.spike_guard_rewind]
            self.strikes = recent + [iteration]
        # rolled back once: its batches vetoed as they come
        stretch = self._learnt_stretch(iteration, reason, cause)
        if stretch:
            self.strikes = []
        elif learnt and diagnosis and len(self.strikes) >= ladder.spike_guard_max_skips:
            # the stretch that taught it: from spike_guard_rewind before its first spike to this one
            start = max(1, self.strikes[0] - ladder.spike_guard_rewind)
            return self._rollback(iteration, reason, start, iteration, cause)
        return self._skip(iteration, outcome, reason, cause, diagnosis, stretch)

    @staticmethod
    def _cause_of(diagnosis):
        """The diagnosis's part that a decision carries: its cause, evidence and suspect samples."""
        cause = (
            {"cause": diagnosis["cause"], "evidence": diagnosis["evidence"]} if diagnosis else {}
        )
        if diagnosis and diagnosis.get("suspects"):
            cause["suspects"] = diagnosis["suspects"]
        return cause

    def _optimizer_strike(self, iteration, reason, cause, diagnosis):
        """An optimizer-driven spike: roll back to before it now, skipping no data (_rollback)."""
        # it came back within spike_guard_rewind of an optimizer rollback, which had changed the LR
        cause["persistent"] = any(
            d.get("cause") == "optimizer"
            and d["action"] == "rollback"
            and abs(iteration - d["iteration"]) <= self.ladder.spike_guard_rewind
            for d in self.decisions
        )
        self.strikes = [iteration]
        reason += f"; {self._cause_words(cause)}: {diagnosis['evidence']}"
        return self._rollback(
            iteration,
            reason,
            iteration - 1,
            None,
            cause,
            diagnosis.get("since"),
            self._to_trend(diagnosis.get("update_size")),
        )

    def _skip(self, iteration, outcome, reason, cause, diagnosis, stretch):
        """Skip the spike's update, or stop past spike_guard_max_skipped_iters skipped."""
        ladder = self.ladder
        if outcome == "vetoed":
            self.skipped_iters += 1
        if self.skipped_iters > ladder.spike_guard_max_skipped_iters:
            return self._decide(
                iteration,
                "stop",
                reason,
                f"{self.skipped_iters} iterations skipped, more than "
                f"spike_guard_max_skipped_iters={ladder.spike_guard_max_skipped_iters}",
                **cause,
            )
        what = "update skipped" if outcome == "vetoed" else "no update"
        decision = self._decide(
            iteration,
            "skip",
            reason,
            f"{what} ("
            + (
                "more of a stretch of text learnt by heart already rolled back: skipped as it comes"
                if stretch
                else "nothing more is done without a cause"
                if not diagnosis
                else f"spike {len(self.strikes)} of {ladder.spike_guard_max_skips} of the stretch "
                "before a rollback"
                if LEARNT in reason
                else "this batch alone: no rollback, nothing skipped ahead"
            )
            + ")",
            **cause,
        )
        self.decisions.append(decision)
        return decision

    def _learnt_stretch(self, iteration, reason, cause):
        """Is this data strike, text learnt by heart, one more of a stretch already rolled back: a learnt-by-heart
        rollback, and learnt-by-heart decisions each within spike_guard_window iterations of the next since? The
        rollback undid what the stretch taught before it was noticed; the rest is vetoed while it happens, so a
        block of one batch repeated 91 times costs one rollback, not one every spike_guard_max_skips strikes until
        spike_guard_max_rollbacks stops the run (the fourth campaign's trials 9 and 60: docs/spike_guard.md)."""
        if cause.get("cause") != "data" or LEARNT not in reason:
            return False
        last = iteration
        for d in reversed(self.decisions):
            if d.get("cause") != "data" or LEARNT not in d["reason"]:
                continue
            if last - d["iteration"] > self.rules.spike_guard_window:
                return False
            if d["action"] == "rollback":
                return True
            last = d["iteration"]
        return False

    def _to_trend(self, move):
        """An optimizer rollback's LR factor: spike_guard_lr_factor, or less where the weights' move per update since
        the snapshot (Guard.update_size's reading, None: not measured) says the LR is further off its trend -- an LR
        x82 cut x0.5 at each of three rollbacks is still x10 (the fourth campaign's trials 84 and 98)."""
        expected, factor = self.series["update"].expected(), self.ladder.spike_guard_lr_factor
        if (
            move is None
            or expected is None
            or len(self.series["update"].values) < 3
            or not math.isfinite(move)
        ):
            return None
        return min(expected / move, factor) if move > 0 else factor

    @staticmethod
    def _cause_words(cause):
        return (
            "optimizer-driven (persistent)"
            if cause.get("persistent")
            else f"{cause.get('cause', '')}-driven"
        )

    def _rebase(self, iteration, outcome, reason, cause, loss, grad_norm):
        """A regime change (the data moved, the weights did not: diagnosis.unseen_verdict): this update skipped,
        the trend lines moved to the unseen batch's numbers (Detector.rebase) and the episode's strikes cleared, so
        that the batches of the new regime are judged against it rather than each called an outlier."""
        self.rebase(loss, grad_norm)
        self.strikes = []
        if outcome == "vetoed":
            self.skipped_iters += 1
        what = "update skipped" if outcome == "vetoed" else "no update"
        decision = self._decide(
            iteration,
            "skip",
            reason,
            f"{what}; a regime change, not a fault: the trend re-based "
            f"to loss {loss:.4g}, grad norm {grad_norm:.4g}",
            rebased=True,
            **cause,
        )
        self.decisions.append(decision)
        return decision

    def _rollback(self, iteration, reason, start, end, cause, since=None, factor=None):
        """Roll back to before `start` and skip iterations start-end (end None: skip no data). A rollback that
        would replay the same trajectory is never taken: without a data skip, and unless the LRs since the
        snapshot `since` (None: not known) were not the schedule's, the LR is cut from the first rollback on (OPT's
        remedy). factor: the cut, spike_guard_lr_factor unless the weights' move per update says by how much the LR
        is off its trend (_to_trend, moved_too_far)."""
        ladder = self.ladder
        skipping = 0 if end is None else end - start + 1
        if self.rollbacks >= ladder.spike_guard_max_rollbacks:
            return self._decide(
                iteration,
                "stop",
                reason,
                f"another rollback would exceed spike_guard_max_rollbacks"
                f"={ladder.spike_guard_max_rollbacks}",
                start=start,
                **cause,
            )
        if self.skipped_iters + skipping > ladder.spike_guard_max_skipped_iters:
            return self._decide(
                iteration,
                "stop",
                reason,
                f"skipping iterations {start}-{end} would exceed "
                f"spike_guard_max_skipped_iters={ladder.spike_guard_max_skipped_iters}",
                start=start,
                **cause,
            )
        relapse = self.rollbacks > 0
        cuts = cause.get("cause") == "optimizer"  # the optimizer's remedy, on its diagnosis only
        same = end is None and since is not None and self.replays_same_lrs(since, iteration)
        cut = ladder.spike_guard_lr_factor if factor is None else factor
        lr_scale = self.lr_scale * (cut if cuts and (relapse or same) else 1.0)
        reset = relapse and cuts and ladder.spike_guard_reset_optimizer
        plan = f"roll back to before iteration {start} and " + (
            "skip no data" if end is None else f"skip iterations {start}-{end}"
        )
        to_trend = "" if factor is None else f" (x{cut:.3g}: the move per update back to its trend)"
        if relapse and not cuts:
            plan += f"; relapse {self.rollbacks}, of the data: LR unchanged"
        elif relapse and cut != 1.0:
            plan += f"; relapse {self.rollbacks}: LR x{lr_scale:.3g} from now on{to_trend}"
            plan += ", optimizer reset with an lr=0 warm-up" if reset else ""
        elif same:
            plan += f"; the same data at the same LRs would replay the spike: LR x{lr_scale:.3g} from now on{to_trend}"
        elif factor is not None:
            plan += "; the LRs since were not the schedule's: LR unchanged"
        return self._decide(
            iteration,
            "rollback",
            reason,
            plan,
            start=start,
            end=end,
            lr_scale=lr_scale,
            reset_optimizer=reset,
            **cause,
        )

    def moved_too_far(self, iteration, reason, move, then):
        """The weights moved per update far more than their trend says (Detector.moved; update_size.py), with or
        without a loss spike: the optimizer's doing (an LR too high, a corrupted optimizer state). Roll back to the
        state the move was measured from (iteration `then`), skip no data, and scale the LR by trend / move so that
        the move comes back to its trend -- a x0.5 cut would leave an LR x35 at x17 -- where a replay would meet
        the same LRs (all but fault injection's events in time: replays_same_lrs). Said in one line."""
        expected = self.series["update"].expected()
        to_trend = (
            min(expected / move, 1.0) if math.isfinite(move) else self.ladder.spike_guard_lr_factor
        )
        # fault injection's event in time: the rollback ends it
        if not self.replays_same_lrs(then, iteration):
            to_trend = 1.0
        evidence = (
            f"the weights moved {move:.3g} of their norm per update since iteration {then}, against a "
            f"trend of {expected:.3g}; no weight moved farther than the optimizer can move it at the "
            "LRs applied"
        )
        self.strikes = [iteration]
        return self._rollback(
            iteration,
            f"{reason}; optimizer-driven: {evidence}",
            then + 1,
            None,
            {"cause": "optimizer", "evidence": evidence, "update_size": move},
            then,
            to_trend,
        )

    def _hardware(self, iteration, outcome, loss, grad_norm, lr, diagnosis):
        """A transient fault: a step that its replay (or the other DP replicas) did not reproduce -- the retried
        step stands -- or weights that the optimizer cannot have written (diagnosis["rollback"]) -- roll back to
        the snapshot before them. No data is skipped and the LR is not cut. Repeated on one rank: stop, naming it."""
        rank, cap = diagnosis["rank"], self.ladder.spike_guard_max_hardware_faults
        rollback = diagnosis.get("rollback", False)
        if outcome == "ok" and not rollback:
            self.record(loss, grad_norm, lr)
        self.faults[rank] = self.faults.get(rank, 0) + 1
        where = "an unknown DP rank (the replicas agreed)" if rank is None else f"DP rank {rank}"
        reason = f"hardware/transient fault on {where}: {diagnosis['evidence']}"
        cause = {"cause": "hardware", "evidence": diagnosis["evidence"], "rank": rank}
        if rollback:  # the corrupted weight is in the state: a stop saves the state before it
            cause["start"] = iteration - 1
        if rank is not None and parallel.grid.dp_rank == rank and parallel.grid.tp_rank == 0:
            print(
                f"spike guard: iteration {iteration}: DP rank {rank} is global rank {parallel.grid.rank} on host "
                f"{socket.gethostname()}",
                flush=True,
            )
        if self.faults[rank] >= cap:
            return self._decide(
                iteration,
                "stop",
                reason,
                f"{self.faults[rank]} faults on {where}, the "
                f"spike_guard_max_hardware_faults={cap}th: take its node out",
                **cause,
            )
        count = f"no data skipped, LR unchanged (fault {self.faults[rank]} of {cap} on {where} before a stop)"
        # booked by applied(), not counted against spike_guard_max_rollbacks nor as a relapse
        if rollback:
            return self._decide(
                iteration,
                "rollback",
                reason,
                f"roll back to before iteration {iteration - 1}; {count}",
                end=None,
                lr_scale=self.lr_scale,
                reset_optimizer=False,
                **cause,
            )
        what = (
            "step retried and applied" if outcome == "ok" else "no update (the retry differed too)"
        )
        decision = self._decide(iteration, "retry", reason, f"{what}; {count}", **cause)
        self.decisions.append(decision)
        return decision

    def _numerical(self, iteration, loss, grad_norm, lr, scaler, diagnosis):
        """A half-precision step whose fp32 replay was ordinary: the fp32 step was applied (investigate()); no
        data skipped, no LR cut, nothing rolled back; with fp16's dynamic loss scale, the scale halved once per
        episode and never to its floor (a scale of 1 helps no overflow and underflows every small gradient). A
        fault that persists -- spike_guard_max_numerical diagnoses within spike_guard_rewind iterations -- is
        named as such, and never stops the run: a stop ends it worse than the half-precision steps would have,
        and the fp32 step each diagnosis computes anyway is the repair. An fp16 overflow's later steps are left
        to the loss scaler (_overflow_left_to_the_scaler)."""
        ladder = self.ladder
        self.record(loss, grad_norm, lr)
        fresh = not self.numericals or iteration - self.numericals[-1] > ladder.spike_guard_rewind
        self.numericals = [
            n for n in self.numericals if iteration - n <= ladder.spike_guard_rewind
        ] + [iteration]
        self.aside = self.aside and not fresh
        reason = f"{self.pending}; numerical: " if self.pending else "numerical: "
        self.pending = None
        persistent = len(self.numericals) >= ladder.spike_guard_max_numerical
        if persistent and diagnosis.get("overflow"):  # without the guard: skipped steps, no stop
            return self._overflow_left_to_the_scaler(iteration, reason, diagnosis)
        return self._numerical_retry(iteration, reason, scaler, fresh, diagnosis, persistent)

    def _overflow_left_to_the_scaler(self, iteration, reason, diagnosis):
        """A persistent fp16 overflow: this fp32 step stands, the loss scaler takes the next."""
        self.aside = True
        plan = (
            f"the fp32 step applied; a persistent fp16 overflow ({len(self.numericals)} "
            f"steps since iteration {self.numericals[0]}): its steps are left to the loss "
            "scaler from now on, skipped as without the guard, until none comes for "
            "spike_guard_rewind iterations; no data skipped, LR unchanged"
        )
        decision = self._decide(
            iteration,
            "retry",
            reason + diagnosis["evidence"],
            plan,
            cause="numerical",
            evidence=diagnosis["evidence"],
            persistent=True,
        )
        self.decisions.append(decision)
        return decision

    def _numerical_retry(self, iteration, reason, scaler, fresh, diagnosis, persistent=False):
        """The fp32 step stands; fp16's loss scale halved at an episode's first diagnosis."""
        plan = "the fp32 step applied; no data skipped, LR unchanged"
        if persistent:
            plan = (
                f"a persistent numerical fault ({len(self.numericals)} half-precision steps since "
                f"iteration {self.numericals[0]} spiked and their fp32 replays did not): "
                f"{plan}, as for each of its steps (a replay and an fp32 replay each); find the "
                "operation (tools/whatif.py, telemetry_interval=1) or train these iterations in fp32; "
                "if it does not end, the run has outgrown its half type: bf16 over fp16 (whose range "
                "tops out at 65,504), qk-layernorm or a lower LR (docs/lessons.md, 6, 20 and 24)"
            )
        if scaler is not None and scaler.dynamic and fresh and scaler.scale / 2 > scaler.min_scale:
            scaler.scale, scaler.clean_steps = scaler.scale / 2, 0
            plan += f", loss scale lowered to {scaler.scale:g}"
        decision = self._decide(
            iteration,
            "retry",
            reason + diagnosis["evidence"],
            plan,
            cause="numerical",
            evidence=diagnosis["evidence"],
            count=len(self.numericals),
            persistent=persistent,
        )
        self.decisions.append(decision)
        return decision

    def _decide(self, iteration, action, reason, plan, **extra):
        decision = {"iteration": iteration, "action": action, "reason": reason, **extra}
        decision["line"] = f"spike guard: iteration {iteration}: {reason}: {plan}"
        print0(decision["line"])
        return decision

    def applied(self, decision, target):
        """Book a rollback (or the stop) once train.py has restored the run to iteration `target`."""
        if decision["action"] == "rollback" and decision.get("cause") != "hardware":
            self.rollbacks += 1
            if decision["end"] is not None:
                self.skip_ranges.append((decision["start"], decision["end"]))
                self.skipped_iters += decision["end"] - decision["start"] + 1
            self.lr_scale = decision["lr_scale"]
        self.strikes = []
        decision["restored_iteration"] = target
        self.decisions.append({k: v for k, v in decision.items()})


# -----------------------------------------------------------------------------
# Warning before the spike: the precursor rung (docs/spike_guard.md, section 7)


def precursor_rung(guard, precursor_cfg, adam_eps, iteration, telemetry):
    """The early rung (`spike_guard_precursor`, off by default), called with each telemetry record: when the
    precursor passes `spike_guard_precursor_threshold`, multiply the LR by `spike_guard_precursor_lr_factor` from
    the next iteration on, through guard.lr_scale (the factor a relapse uses; checkpoints keep it). Once per
    crossing: the rung is armed again when the precursor is back on the safe side. It sees only the iterations
    telemetry records (every telemetry_interval), whose numbers are reduced over all ranks: every rank decides
    alike. Its state is its entries in guard.decisions (kept by checkpoints, never rolled back), so a resumed run
    neither repeats nor forgets a cut. Returns the decision (also one `spike guard:` line) or None."""
    p = precursor_cfg  # adam_eps: the optimizer's, which grad_rms_over_eps is measured against
    name, threshold = p.spike_guard_precursor, p.spike_guard_precursor_threshold
    if name is None:
        return None
    value = precursors.value(name, telemetry, adam_eps)
    mine = [d for d in guard.decisions if d["action"] in ("precursor", "precursor rearmed")]
    armed = not mine or mine[-1]["action"] == "precursor rearmed"
    crossed = precursors.past(name, value, threshold)
    high = precursors.PRECURSORS[name][1] == "high"
    if not armed and not crossed:
        reason = (
            f"{name} {value:.4g} is back {'under' if high else 'over'} its threshold {threshold:g}"
        )
        decision = guard._decide(
            iteration, "precursor rearmed", reason, "the precursor rung is armed again"
        )
    elif armed and crossed:
        guard.lr_scale *= p.spike_guard_precursor_lr_factor
        reason = f"{name} {value:.4g} is {'over' if high else 'under'} its threshold {threshold:g}"
        decision = guard._decide(
            iteration,
            "precursor",
            reason,
            f"warning before a spike: LR x{guard.lr_scale:g} from the next iteration on",
            lr_scale=guard.lr_scale,
            value=value,
        )
    else:  # armed and on the safe side, or already acted on this crossing
        return None
    guard.decisions.append(decision)
    return decision
