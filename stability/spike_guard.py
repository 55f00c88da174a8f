"""The spike guard: the chronicles' firefighting done by the run itself (lessons 8, 9, 21), after a diagnosis.

The tr8b-104B team watched the loss, rolled back to a checkpoint, skipped a window of data with
skip_train_iteration_range, lowered the LR or reset the optimizer, and relaunched -- by hand, for days. PaLM wrote
the recipe down (restart ~100 steps before the spike, skip 200-500 batches); OLMo-core automated its first rung.
But the causes call for different remedies, so the guard asks why before it acts (docs/spike_guard.md):

  detect     a step's loss is more than `spike_guard_zscore` scatters above the line fitted to the last 16
             applied losses and above `spike_guard_ema_ratio` x that line's value (the scatter: the line's past
             prediction errors, Series); or its grad norm (its logarithm) the same and above
             `spike_guard_grad_norm_ratio` x; or the loss half as far off its line, above or below (a
             degenerate batch the model finds easy), with an outlying grad norm; or
             `spike_guard_rise_steps` losses in a row each half as far above (a slow rise the line follows);
             or the loss is NaN/inf; or the DP replicas computed different numbers; or (fp16) the loss scale
             collapsed to min_loss_scale. From `spike_guard_min_steps` applied steps on (in fp16 the losses of
             the loss scale's search count): the trend makes the warm-up ordinary.
  diagnose   (investigate(), before any update) replay the step, same weights, batch and RNG:
               the same DP rank disagrees again                -> persistent: stop, naming the rank
               not reproduced (beyond the run's measured nondeterminism), or the replicas disagreed
                                                               -> hardware: the replayed step is applied (a retry)
               reproduced:
                 a weight moved farther since the newest snapshot two updates back than Adam can move it
                                                           -> hardware: roll back to it, no data skipped, no LR cut
                 fp16/bf16: the step replayed in fp32 (TF32 off) is ordinary
                                                           -> numerical: the fp32 step applied (fp16: the loss scale
                                                              halved once per episode, never to its floor);
                                                              spike_guard_max_numerical in a window: stop, naming it
                 counterfactual: the last applied batch on these same weights (computed, never applied)
                   ordinary                                    -> data: this batch is the cause (either sign); a
                                                                  minority of its samples, if far off, is named
                   a spike too                                 -> optimizer: roll back at once, skip no data, and
                                                                  cut the LR unless the LRs since the snapshot
                                                                  were not the schedule's: no rollback replays
             Every decision line says which test removed the spike, with its numbers.
             The spike_guard_max_hardware_faults-th hardware fault on one DP rank stops the run, naming it.
  act (data) (a) skip the update: no weight, Adam moment, step counter or LR-schedule change;
             (b) at the `spike_guard_max_skips`-th spike within `spike_guard_rewind` iterations: roll back to the
                 newest snapshot (host copy, or disk checkpoint) before the spike window and add the window -- from
                 `spike_guard_rewind` before the first spike to `spike_guard_skip_after` after the last -- to the
                 run's skip ranges;
             (c) on a relapse (any later rollback, of either cause): also multiply the LR by
                 `spike_guard_lr_factor` and, with `spike_guard_reset_optimizer`, reset the optimizer with the
                 lr=0 warm-up of lesson 8.
             Rollbacks and skipped iterations are capped; at a cap the run saves its last good state and exits
             with code 3 and a message.
  explain    every decision is one `spike guard: ...` line with its cause and evidence, a record in metrics.jsonl
             and an entry in the run state of the checkpoint; a resumed run honours the skip ranges and the LR
             factor and never decides again. The highest-loss samples of a spiking batch are named and decoded,
             and a data spike's documents appended to the skip list (skip_list.py).
  warn       (precursor_rung(), off by default) a telemetry precursor past its threshold cuts the LR once, before
             any spike (docs/spike_guard.md, section 7).

The guard's state has two parts. Its statistics (the recent losses and grad norms) belong to the weights and are
rolled back with them; its decisions (skip ranges, LR factor, counters, faults per rank, the decision log) are
history and never are. Every replica decides from DP rank 0's numbers (agreed()), so replicas cannot split.

Fault injection, to make a spike on purpose (Megatron-LM's --error-injection-*): `inject_bad_batch_iters`
replaces the batches of those iterations by random token ids (data: it comes back when the iterations are run
again), `inject_lr_iters` multiplies their LR by `inject_lr_factor` (schedule.lr_at), `inject_bitflip_iters`
flips a bit of a reduced gradient, or of a weight after the update (`inject_bitflip_target`), on
`inject_bitflip_rank` (bitflip()); these two are events in time: a replay or a rollback does not meet them again
(SpikeGuard.meets_fault). `inject_numerical_iters` adds a cancellation that half precision loses and fp32 keeps
(inject_numerical()).
"""
import collections
import math
import socket

import torch
import torch.distributed as dist

import checkpoint
import loader
import optim
import parallel
import precision
import schedule
import training
from report import print0
from stability import skip_list

EXIT_CODE = 3


class SpikeGuardStop(training.StopRun):
    """A cap was reached: the run saved its last good state and stops (train.py exits with EXIT_CODE)."""
    exit_code = EXIT_CODE


# -----------------------------------------------------------------------------
# Detection and decisions


class Series:
    """One watched number (the loss, or the logarithm of the grad norm), judged against its own trend.

    A z-score over a long window fails on a loss that is still falling fast: the window's spread is the fall
    itself, so a 50% jump can be under 6 std. Here a line is fitted to the last FIT applied values, and a step is
    judged by how far it lands above the line's next point, in units of the scatter: 1.4826 x the median of the
    line's past prediction errors (each value against the line fitted to the FIT values before it), robust to a
    spike that got through. The residuals around the line itself measure the scatter too, but over 16 points they
    are often small by chance: a clean 3,000-iteration run had a batch 3.4 noise widths above its trend called
    12 "spreads" (docs/spike_guard.md, the campaign). Until FIT // 2 prediction errors exist (the first steps,
    whose fall a line of fewer points would misjudge) the residuals stand in; after, the larger of the two."""

    FIT = 16

    def __init__(self, window, log=False):
        self.log = log
        self.values = collections.deque(maxlen=window)  # applied steps (logarithms for the grad norm)
        self.errors = collections.deque(maxlen=window)  # |value - the line's prediction of it|, from FIT values on
        self.zs = collections.deque(maxlen=window)  # each applied value's z when it was judged (rising())

    def transform(self, value):
        return math.log(max(value, 1e-30)) if self.log else float(value)

    def line(self):
        """(the next point of the line fitted to the last FIT values, the residuals' robust scatter), or None."""
        ys = list(self.values)[-self.FIT:]
        n = len(ys)
        if n < 2:
            return None
        xm, ym = (n - 1) / 2, sum(ys) / n
        slope = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))
        residuals = sorted(abs(y - ym - slope * (i - xm)) for i, y in enumerate(ys))
        return ym + slope * (n - xm), 1.4826 * residuals[n // 2]

    def fit(self):
        """(the line's next point, the scatter to judge it by), or None before two values."""
        found = self.line()
        if found is None or len(self.errors) < self.FIT // 2:
            return found
        errors = sorted(self.errors)
        return found[0], max(found[1], 1.4826 * errors[len(errors) // 2])

    def append(self, x):
        """A transformed value: its z and prediction error first (the line before it), then the value."""
        found = self.fit()
        self.zs.append(0.0 if found is None else scatters(x, *found))
        if len(self.values) >= self.FIT:
            self.errors.append(abs(x - found[0]))
        self.values.append(x)

    def record(self, value):
        self.append(self.transform(value))

    def judge(self, value):
        """(z, ratio): how many scatters above the line's next point, and its multiple of that value ((0, 1) before
        two values: an fp16 run's grad norms wait for the loss scale's search, its losses do not)."""
        if len(self.values) < 2:
            return 0.0, 1.0
        x, (p, s) = self.transform(value), self.fit()
        return scatters(x, p, s), math.exp(x - p) if self.log else (value / p if p > 0 else math.inf)

    def rising(self, z, steps, bar):
        """Whether a value judged z (judge()) and the last steps - 1 applied ones each landed more than `bar`
        scatters above their line's prediction: a rise the line follows (an LR too high), none of whose steps is a
        spike alone."""
        if len(self.errors) < self.FIT // 2 or len(self.zs) < steps - 1:
            return False
        return z > bar and all(past > bar for past in list(self.zs)[len(self.zs) - steps + 1:])

    def expected(self):
        found = self.fit()
        return None if found is None else math.exp(found[0]) if self.log else found[0]

    def state(self):
        return {"values": list(self.values), "errors": list(self.errors), "zs": list(self.zs)}

    def load(self, state):
        """A snapshot's or checkpoint's state; without its errors and zs (the run's history, RunState.history, or
        a state written before the zs were kept), they are computed again from the values."""
        for kept in (self.values, self.errors, self.zs):
            kept.clear()
        if state and "zs" in state:
            self.values.extend(state["values"])
            self.errors.extend(state["errors"])
            self.zs.extend(state["zs"])
            return
        for x in (state or {}).get("values", []):
            self.append(x)


def scatters(x, predicted, scatter):
    """How many scatters x lands above the line's prediction."""
    return (x - predicted) / scatter if scatter > 0 else (math.inf if x > predicted else 0.0)


class SpikeGuard:
    def __init__(self, cfg, saved=None):
        self.cfg = cfg
        self.enabled = cfg.spike_guard
        # statistics of applied steps: rolled back with the weights
        self.series = {"loss": Series(cfg.spike_guard_window), "grad norm": Series(cfg.spike_guard_window, log=True)}
        self.lr_sum = 0.0  # the learning rates of the applied steps, summed: how far Adam can have moved a weight
        self.last_applied = None  # [iteration, first sample, micro-batches, seqlen] of the last applied step
        # decisions: never rolled back
        self.strikes = []  # iterations of the spikes of the current episode
        self.skip_ranges = []  # [start, end] inclusive, added by rollbacks
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped_iters = 0
        self.decisions = []
        self.faults = {}  # DP rank (None: unknown) -> transient faults seen on it
        self.last_run = 0  # the highest iteration run (fault injection happens once in time)
        self.pending = None  # why the current step is a spike (judge -> update)
        self.numericals = []  # iterations of the numerical diagnoses of the current window (persistence)
        self.lrs = {}  # iteration -> (the LR its replay would get, the LR applied): does a rollback change anything?
        self.noise = None  # the run's own nondeterminism: relative difference of a forward and its repeat
        if saved:
            self.load_state_dict(saved)

    # -- state -----------------------------------------------------------------------------------------------

    def stats(self):
        return {**{name: series.state() for name, series in self.series.items()}, "lr sum": self.lr_sum,
                "last applied": self.last_applied}

    def load_stats(self, stats=None):
        """The statistics of a snapshot or checkpoint (None: one written without the guard, start afresh)."""
        for name, series in self.series.items():
            series.load((stats or {}).get(name))
        self.lr_sum = (stats or {}).get("lr sum", 0.0)
        self.last_applied = (stats or {}).get("last applied")

    def record(self, loss, grad_norm, lr):
        """An applied step."""
        self.series["loss"].record(loss)
        self.series["grad norm"].record(grad_norm)
        self.lr_sum += lr

    def state_dict(self):
        return {"stats": self.stats(), "strikes": list(self.strikes), "skip_ranges": [list(r) for r in
                self.skip_ranges], "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                "skipped_iters": self.skipped_iters, "decisions": list(self.decisions), "faults": dict(self.faults),
                "last_run": self.last_run, "noise": self.noise}

    def load_state_dict(self, sd):
        self.load_stats(sd["stats"])
        self.strikes = list(sd["strikes"])
        self.skip_ranges = [tuple(r) for r in sd["skip_ranges"]]
        self.lr_scale, self.rollbacks, self.skipped_iters = sd["lr_scale"], sd["rollbacks"], sd["skipped_iters"]
        self.decisions = list(sd["decisions"])
        self.faults, self.last_run = dict(sd.get("faults", {})), sd.get("last_run", 0)
        self.noise = sd.get("noise")

    # -- what the training loop asks -------------------------------------------------------------------------

    def skips(self, iteration):
        return schedule.in_ranges(iteration, self.skip_ranges)

    def armed(self, state=None):
        """Judging starts once spike_guard_min_steps applied steps are recorded (its own warm-up: the trend
        makes the LR warm-up's falling loss and rising grad norm ordinary)."""
        return self.enabled and len(self.series["loss"].values) >= self.cfg.spike_guard_min_steps

    def judge(self, loss, grad_norm):
        """Before the update (the step's update_factor): why this step is a spike, or None."""
        cfg, reasons = self.cfg, []
        judged = {"loss": self.series["loss"].judge(loss), "grad norm": self.series["grad norm"].judge(grad_norm)}
        for name, value in (("loss", loss), ("grad norm", grad_norm)):
            series, (z, ratio) = self.series[name], judged[name]
            bar = cfg.spike_guard_grad_norm_ratio if name == "grad norm" else cfg.spike_guard_ema_ratio
            if z > cfg.spike_guard_zscore and ratio > bar:
                reasons.append(f"{name} {value:.4g} is {ratio:.2f}x its trend's {series.expected():.4g}, {z:.1f} "
                               f"spreads above it")
        norms = self.series["grad norm"].values
        if len(norms) < 2 and cfg.clip_grad and grad_norm > cfg.spike_guard_grad_norm_ratio * cfg.clip_grad:
            # fp16 while the loss scale searches: the losses are recorded, the grad norms are not (inf); until they
            # have a trend, clip_grad stands in for it
            reasons.append(f"grad norm {grad_norm:.4g} is {grad_norm / cfg.clip_grad:.2f}x clip_grad (no trend yet)")
        # a loss off its trend by half the bar, on either side, with an outlying grad norm: a step that moved both.
        # Above: the default run's LR x30 at 60 (3.9 scatters of a fast fall's errors, grad norm 7.8); below: a
        # degenerate batch the model finds easy (tr8-104B's backslash-only samples). A grad-norm jump alone under
        # its bar is a clean run's.
        (z, ratio), (gz, gratio) = judged["loss"], judged["grad norm"]
        half, bar = cfg.spike_guard_zscore / 2, cfg.spike_guard_ema_ratio
        if not reasons and (z > half and ratio > bar or z < -half and ratio < 1 / bar) \
                and gz > cfg.spike_guard_zscore and gratio > bar:
            reasons.append(f"loss {loss:.4g} is {ratio:.2f}x its trend's {self.series['loss'].expected():.4g}, "
                           f"{abs(z):.1f} spreads {'above' if z > 0 else 'below'} it, with grad norm {grad_norm:.4g} "
                           f"{gratio:.2f}x its trend's")
        # a slow rise: the line tilts with it, so no step is a spike alone (the campaign's LR x37 from 158 on)
        steps, losses = cfg.spike_guard_rise_steps, self.series["loss"]
        if not reasons and steps and losses.rising(z, steps, half):
            rise = ", ".join(f"{v:.4g}" for v in [*list(losses.values)[-(steps - 1):], loss])
            reasons.append(f"loss rose {steps} steps in a row, each more than {half:g} spreads above its trend: {rise} "
                           f"(trend now {losses.expected():.4g})")
        self.pending = "; ".join(reasons) or None
        return self.pending

    def meets_fault(self, iteration, ranges):
        """Does fault injection strike this iteration? An injected LR spike or bit flip is an event in time:
        it strikes the first pass through its iterations, and a rollback decided after it began ends it (the
        iterations run again, and the rest of its range, do not meet it). A bad batch is data: it comes back."""
        for start, end in ranges:
            if schedule.in_ranges(iteration, [(start, end)]):
                rolled_back = any(d["action"] == "rollback" and d["iteration"] >= start for d in self.decisions)
                return iteration > self.last_run and not rolled_back
        return False

    def update(self, iteration, outcome, loss, grad_norm, scaler, diagnosis=None, lr=0.0):
        """After train_step (and investigate()): record an applied step (at learning rate lr), or decide what a
        spike calls for, from its diagnosis. Returns the decision (a dict: action skip | retry | rollback | stop,
        with its reason, cause, evidence and line) or None."""
        self.last_run = max(self.last_run, iteration)
        if diagnosis is not None and diagnosis["cause"] == "hardware":
            return self._hardware(iteration, outcome, loss, grad_norm, lr, diagnosis)
        if diagnosis is not None and diagnosis["cause"] == "numerical":
            return self._numerical(iteration, loss, grad_norm, lr, scaler, diagnosis)
        if diagnosis is not None and diagnosis["cause"] == "persistent":  # a retry on that rank cannot help
            return self._decide(iteration, "stop", f"persistent fault on DP rank {diagnosis['rank']}: "
                                f"{diagnosis['evidence']}", "the same rank disagrees on replay: take its node out",
                                cause="persistent", evidence=diagnosis["evidence"], rank=diagnosis["rank"],
                                start=iteration - 1)
        if outcome == "ok":
            self.record(loss, grad_norm, lr)
            return None
        if not self.enabled:
            return None
        if outcome == "skipped" and scaler is not None and scaler.dynamic and math.isfinite(loss) \
                and not math.isfinite(grad_norm) and scaler.scale > scaler.min_scale:
            # the loss scale's search: the loss is the weights' (no update was made), so the guard arms on it
            # even while the scale searches; a fault early in fp16 is judged, not learnt as the trend
            self.series["loss"].record(loss)
            return None
        collapse = False
        if outcome == "vetoed":
            reason = self.pending
        elif outcome == "nan":
            reason = f"the loss is {loss}"
        elif outcome == "skipped" and not math.isfinite(grad_norm):
            if scaler.dynamic:  # an fp16 overflow is the loss scaler's business, until the scale has collapsed
                if scaler.scale > scaler.min_scale:
                    return None
                collapse, reason = True, f"the fp16 loss scale collapsed to {scaler.scale}"
            else:
                reason = f"the grad norm is {grad_norm}"
        else:
            return None  # skip_grad_norm_above: OPT's rule, not a spike
        self.pending = None
        cfg = self.cfg
        cause = {"cause": diagnosis["cause"], "evidence": diagnosis["evidence"]} if diagnosis else {}
        if diagnosis and diagnosis.get("suspects"):
            cause["suspects"] = diagnosis["suspects"]
        if diagnosis:
            reason += f"; {diagnosis['cause']}-driven: {diagnosis['evidence']}"
        if cause.get("cause") == "optimizer":  # the weights are already damaged: skipping updates cannot help
            self.strikes = [iteration]
            return self._rollback(iteration, reason, iteration - 1, None, cause, diagnosis.get("since"))
        self.strikes = [s for s in self.strikes if iteration - s <= cfg.spike_guard_rewind] + [iteration]
        if not collapse and len(self.strikes) < cfg.spike_guard_max_skips:
            if outcome == "vetoed":
                self.skipped_iters += 1
            if self.skipped_iters > cfg.spike_guard_max_skipped_iters:
                return self._decide(iteration, "stop", reason, f"{self.skipped_iters} iterations skipped, more than "
                                    f"spike_guard_max_skipped_iters={cfg.spike_guard_max_skipped_iters}", **cause)
            what = "update skipped" if outcome == "vetoed" else "no update"
            decision = self._decide(iteration, "skip", reason, f"{what} (spike {len(self.strikes)} of "
                                    f"{cfg.spike_guard_max_skips} before a rollback)", **cause)
            self.decisions.append(decision)
            return decision
        start = max(1, self.strikes[0] - cfg.spike_guard_rewind)
        return self._rollback(iteration, reason, start, iteration + cfg.spike_guard_skip_after, cause)

    def replays_same_lrs(self, since, iteration):
        """Would a rollback to the snapshot of iteration `since` apply the same LRs as the run did since? Only
        fault injection makes a pass's LR differ from its replay's (an event in time); else, with the data and
        the RNG streams restored, the run would replay the spike bit for bit."""
        return all(expected == applied for n, (expected, applied) in self.lrs.items() if since < n <= iteration)

    def _rollback(self, iteration, reason, start, end, cause, since=None):
        """Roll back to before `start` and skip iterations start-end (end None: skip no data). A rollback that
        would replay the same trajectory is never taken: without a data skip, and unless the LRs since the
        snapshot `since` (None: not known) were not the schedule's, the LR is cut from the first rollback on (OPT's
        remedy)."""
        cfg = self.cfg
        skipping = 0 if end is None else end - start + 1
        if self.rollbacks >= cfg.spike_guard_max_rollbacks:
            return self._decide(iteration, "stop", reason, f"another rollback would exceed spike_guard_max_rollbacks"
                                f"={cfg.spike_guard_max_rollbacks}", start=start, **cause)
        if self.skipped_iters + skipping > cfg.spike_guard_max_skipped_iters:
            return self._decide(iteration, "stop", reason, f"skipping iterations {start}-{end} would exceed "
                                f"spike_guard_max_skipped_iters={cfg.spike_guard_max_skipped_iters}", start=start,
                                **cause)
        relapse = self.rollbacks > 0
        same = end is None and since is not None and self.replays_same_lrs(since, iteration)
        lr_scale = self.lr_scale * (cfg.spike_guard_lr_factor if relapse or same else 1.0)
        reset = relapse and cfg.spike_guard_reset_optimizer
        plan = f"roll back to before iteration {start} and " + (
            "skip no data" if end is None else f"skip iterations {start}-{end}")
        if relapse:
            plan += f"; relapse {self.rollbacks}: LR x{lr_scale:g} from now on"
            plan += ", optimizer reset with an lr=0 warm-up" if reset else ""
        elif same:
            plan += f"; the same data at the same LRs would replay the spike: LR x{lr_scale:g} from now on"
        return self._decide(iteration, "rollback", reason, plan, start=start, end=end, lr_scale=lr_scale,
                            reset_optimizer=reset, **cause)

    def _hardware(self, iteration, outcome, loss, grad_norm, lr, diagnosis):
        """A transient fault: a step that its replay (or the other DP replicas) did not reproduce -- the retried
        step stands -- or weights that the optimizer cannot have written (diagnosis["rollback"]) -- roll back to
        the snapshot before them. No data is skipped and the LR is not cut. Repeated on one rank: stop, naming it."""
        cfg, rank, cap = self.cfg, diagnosis["rank"], self.cfg.spike_guard_max_hardware_faults
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
            print(f"spike guard: iteration {iteration}: DP rank {rank} is global rank {parallel.grid.rank} on host "
                  f"{socket.gethostname()}", flush=True)
        if self.faults[rank] >= cap:
            return self._decide(iteration, "stop", reason, f"{self.faults[rank]} faults on {where}, the "
                                f"spike_guard_max_hardware_faults={cap}th: take its node out", **cause)
        count = f"no data skipped, LR unchanged (fault {self.faults[rank]} of {cap} on {where} before a stop)"
        if rollback:  # booked by applied(), not counted against spike_guard_max_rollbacks nor as a relapse
            return self._decide(iteration, "rollback", reason, f"roll back to before iteration {iteration - 1}; "
                                f"{count}", end=None, lr_scale=self.lr_scale, reset_optimizer=False, **cause)
        what = "step retried and applied" if outcome == "ok" else "no update (the retry differed too)"
        decision = self._decide(iteration, "retry", reason, f"{what}; {count}", **cause)
        self.decisions.append(decision)
        return decision

    def _numerical(self, iteration, loss, grad_norm, lr, scaler, diagnosis):
        """A half-precision step whose fp32 replay was ordinary: the fp32 step was applied (investigate()); no
        data skipped, no LR cut, nothing rolled back; with fp16's dynamic loss scale, the scale halved once per
        episode and never to its floor (a scale of 1 helps no overflow and underflows every small gradient). A
        fault that persists -- spike_guard_max_numerical diagnoses within spike_guard_rewind iterations -- is no
        longer retried step by step: the run saves and stops, naming it (fp32 for each affected step is no plan)."""
        cfg = self.cfg
        self.record(loss, grad_norm, lr)
        fresh = not self.numericals or iteration - self.numericals[-1] > cfg.spike_guard_rewind
        self.numericals = [n for n in self.numericals if iteration - n <= cfg.spike_guard_rewind] + [iteration]
        reason = f"{self.pending}; numerical: " if self.pending else "numerical: "
        self.pending = None
        if len(self.numericals) >= cfg.spike_guard_max_numerical:
            return self._decide(iteration, "stop", reason + diagnosis["evidence"], f"a persistent numerical fault: "
                                f"{len(self.numericals)} half-precision steps since iteration {self.numericals[0]} "
                                "spiked and their fp32 replays did not; find the operation (tools/whatif.py, "
                                "telemetry_interval=1) or train these iterations in fp32", cause="numerical",
                                evidence=diagnosis["evidence"], persistent=True, start=iteration - 1)
        plan = "the fp32 step applied; no data skipped, LR unchanged"
        if scaler is not None and scaler.dynamic and fresh and scaler.scale / 2 > scaler.min_scale:
            scaler.scale, scaler.clean_steps = scaler.scale / 2, 0
            plan += f", loss scale lowered to {scaler.scale:g}"
        decision = self._decide(iteration, "retry", reason + diagnosis["evidence"], plan, cause="numerical",
                                evidence=diagnosis["evidence"], count=len(self.numericals))
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


def spikes_in(series, cfg, stats=None):
    """The iterations of a recorded run [(iteration, loss, grad norm)] that the detector calls spikes, fed as
    train.py feeds it (a spike is not recorded: its update is skipped), from `stats` (a snapshot's) or afresh."""
    guard = SpikeGuard(cfg)
    guard.enabled = True
    guard.load_stats(stats)
    found = []
    for iteration, loss, grad_norm in series:
        if guard.armed() and guard.judge(loss, grad_norm):
            found.append(iteration)
        else:
            guard.update(iteration, "ok", loss, grad_norm, None)
    return found


# -----------------------------------------------------------------------------
# Forensics: why did this step spike? (lesson 21; PaLM, Megatron-LM's rerun state machine)

SUSPECT = ("vetoed", "nan", "replicas differ")  # the train_step outcomes investigate() looks into


def investigate(guard, parts, step, iteration, before, snapshots, rerun, forward, other=None, per_sample=None):
    """Before the guard acts on a suspect step: (step, diagnosis). The weights and optimizer are still those
    before the step (a suspect step is never applied); before = (RNG state, loss scaler state) before it.
    1. replay: the step again, same weights, batch, RNG and loss scaler (rerun(judge, scaler) runs train_step on
       the run's parts, with its scaler unless another is given). Not reproduced
       -- the replay is no spike, or the DP replicas disagreed -- is a transient fault ("hardware"): the replay
       applied its update (the step retried) and its step is returned.
    2. reproduced: are the weights ones the optimizer can have written? Compared with the newest snapshot two
       updates or more back, a weight that moved farther than Adam can move it at the LRs applied since was
       written by something else: a silent corruption ("hardware", rolled back: the replay reproduces it
       because it is in the state).
    3. fp16/bf16: the step replayed in fp32 (same batch, RNG and master weights). Ordinary there: "numerical",
       and the fp32 step was applied and is returned.
    4. the batch on the model of that snapshot (forward() is the loss of the batch on the live model). Still an
       outlier against that model's own trend: "data". The batch is ordinary there, the loss is not now: the
       update went wrong ("optimizer").
    The verdict between 4's two is a counterfactual, asked on both signs of the loss: other() is another batch (the
    last applied one) on the same weights, computed and never applied. Ordinary there: the weights are fine and
    this batch is the cause ("data", however low its loss: a batch of one repeated token has a loss far below its
    trend and a grad norm far above it). A spike there too: the updates since the snapshot did it ("optimizer";
    the rollback changes the trajectory, SpikeGuard._rollback). per_sample() gives the batch's per-sample losses:
    a minority far from the others' median is named (diagnosis "suspects"), with the batch's loss without them.
    "Reproduced" means a spike again whose loss is within the run's own nondeterminism of the first (guard.noise,
    measured when the guard arms, as Megatron's rerun state machine measures what it tolerates); a replay on which
    the same DP rank disagrees again is a persistent fault of that rank, not a transient one.
    Costs one extra step (two in half precision: one of them in fp32), one more step (not applied) for the
    counterfactual and two forwards per spike; a clean run never calls it."""
    model, optimizer = parts.model, parts.optimizer
    first = f"loss {step.loss:.6g}, grad norm {step.grad_norm:.6g}"
    rows = list(training.replica_values)
    differ = [r for r, row in enumerate(rows) if repr(row) != repr(rows[0])]
    rng_before, scaler_before = before
    checkpoint.set_rng_state(rng_before)
    parts.scaler.load_state_dict(scaler_before)  # the step's fp16 overflow counted once, not twice
    replay = rerun(guard.judge if guard.armed() else None)
    again = f"loss {replay.loss:.6g}, grad norm {replay.grad_norm:.6g}"
    rows_again = list(training.replica_values)
    differ_again = [r for r, row in enumerate(rows_again) if repr(row) != repr(rows_again[0])]
    if differ and differ_again[:1] == differ[:1]:
        rank = differ[0]
        return replay, {"cause": "persistent", "rank": rank, "evidence": f"DP rank {rank} computed loss "
                        f"{rows[rank][0]:.6g}, DP rank 0 {first}; replayed, DP rank {rank} again: loss "
                        f"{rows_again[rank][0]:.6g}, DP rank 0 {again}"}
    tolerance = reproduced_tolerance(guard.noise)
    close = (not math.isfinite(step.loss) and not math.isfinite(replay.loss)) or \
        abs(replay.loss - step.loss) <= tolerance * abs(step.loss)
    if replay.outcome in SUSPECT and not close and not differ:
        rank = 0 if parallel.grid.dp_size == 1 else None
        return replay, {"cause": "hardware", "rank": rank, "evidence": f"first {first}; replayed: {again}, a spike "
                        f"that differs by more than the run's nondeterminism allows ({tolerance:.2g} relative)"}
    if differ or replay.outcome not in SUSPECT:
        rank = differ[0] if differ else (0 if parallel.grid.dp_size == 1 else None)
        if differ:
            evidence = (f"DP rank {rank} computed loss {rows[rank][0]:.6g}, grad norm {rows[rank][1]:.6g}, DP rank 0 "
                        f"{first}; replayed: {again}")
        else:
            evidence = f"first {first}; replayed: {again}, not reproduced"
        return replay, {"cause": "hardware", "evidence": evidence, "rank": rank}
    replayed = f"replayed: {again}, reproduced"
    found = snapshots.newest_before(iteration - 1)
    if found is not None:
        corrupted = corrupted_weights(guard, model, optimizer, iteration, *found)
        if corrupted is not None:
            rank, evidence = corrupted
            return replay, {"cause": "hardware", "evidence": f"{replayed}; {evidence}",
                            "rank": rank, "rollback": True}
    if guard.cfg.spike_guard_fp32_replay and precision.name(guard.cfg) != "fp32":
        exact = replay_in_fp32(guard, rng_before, model, optimizer, rerun)
        if exact.outcome == "ok":
            return exact, {"cause": "numerical", "evidence": f"{replayed}; in fp32: loss {exact.loss:.6g}, grad "
                           f"norm {exact.grad_norm:.6g}, ordinary"}
        replayed += f"; in fp32: loss {exact.loss:.6g}, grad norm {exact.grad_norm:.6g}, a spike too"
    if found is None:
        return replay, {"cause": "data", "evidence": f"{replayed}; no earlier snapshot to "
                        "test the batch on"}
    then, payload = found
    rng_after = checkpoint.rng_state()
    counterfactual = other() if other is not None else None
    checkpoint.set_rng_state(rng_after)
    gpt = parallel.unwrap(model)
    live = {k: v.detach().to("cpu", copy=True) for k, v in gpt.state_dict().items()}
    gpt.load_state_dict(payload[0])
    old = forward()
    gpt.load_state_dict(live)
    checkpoint.set_rng_state(rng_after)
    trend = Series(guard.cfg.spike_guard_window)
    trend.load(snapshot_stats(payload).get("loss"))
    expected_then, expected_now = trend.expected(), guard.series["loss"].expected()
    excess_now = replay.loss - expected_now if math.isfinite(replay.loss) else math.inf
    excess_then = old - expected_then if expected_then is not None and math.isfinite(old) else math.inf
    evidence = (f"{replayed}; the batch on the model of iteration {then}: loss {old:.4g}, "
                f"{excess_then:+.3g} against its trend, now {excess_now:+.3g}")
    if counterfactual is not None:  # the counterfactual decides, on either sign of the loss
        (other_step, other_iteration), pending = counterfactual, guard.pending
        spike_there = (not math.isfinite(other_step.loss) or not math.isfinite(other_step.grad_norm)
                       or bool(guard.judge(other_step.loss, other_step.grad_norm)))
        guard.pending = pending
        data = not spike_there
        evidence += (f"; without it (iteration {other_iteration}'s batch on these weights): loss "
                     f"{other_step.loss:.4g}, grad norm {other_step.grad_norm:.4g}, "
                     + ("a spike too" if spike_there else "ordinary"))
    else:  # no other batch to ask (the first armed step): the older model's answer, on the loss's sign alone
        data = excess_then >= 0.5 * excess_now if math.isfinite(excess_now) else not math.isfinite(old)
    diagnosis = {"cause": "data" if data else "optimizer", "since": then}
    if data and per_sample is not None:
        suspects, rest = minority(per_sample())
        if suspects:
            expected = expected_now if expected_now is not None else math.nan
            evidence += (f"; {len(suspects)} samples far from the others (positions {', '.join(map(str, suspects))}), "
                         f"the batch without them: loss {rest:.4g}, trend {expected:.4g}")
            diagnosis["suspects"] = suspects
    diagnosis["evidence"] = evidence + ": the " + (
        "batch is the outlier" if data else "batch is ordinary, the weights are not")
    return replay, diagnosis


def reproduced_tolerance(noise):
    """The relative difference between a spike and its replay still called the same: 16x the run's own measured
    nondeterminism (None: not measured yet), and never under 1e-6 (CPU and deterministic kernels: bit for bit)."""
    return max(16 * (noise or 0.0), 1e-6)


def minority(losses, spread=4.0):
    """([positions], mean loss of the others): the samples of a batch whose losses lie more than `spread` robust
    scatters (1.4826 x the median absolute deviation) from the batch's median, on either side, if they are a
    minority; ([], mean) when none or most are (then the whole batch is the suspect)."""
    values = sorted(losses)
    n = len(values)
    if n < 3:
        return [], sum(values) / max(n, 1)
    median = values[n // 2]
    mad = sorted(abs(v - median) for v in values)[n // 2]
    bar = max(spread * 1.4826 * mad, 0.05 * abs(median))
    far = [i for i, v in enumerate(losses) if abs(v - median) > bar]
    if not far or 2 * len(far) >= n:
        return [], sum(values) / n
    kept = [v for i, v in enumerate(losses) if i not in far]
    return far, sum(kept) / len(kept)


def snapshot_stats(payload):
    """The guard's statistics in a snapshot's (or checkpoint's) run state (run_stats)."""
    return run_stats(payload[1]["state"])


def run_stats(state):
    """The guard's statistics in a run state (a dict): its own when it was on, else the run's history of applied
    steps (run_state.RunState.history, kept with the guard off too) in their form; {} for neither."""
    stats = (state.get("spike_guard") or {}).get("stats")
    if stats:
        return stats
    history = state.get("history") or {}
    series = {"loss": Series(1), "grad norm": Series(1, log=True)}
    return {name: {"values": [s.transform(v) for v in history.get(name, [])]} for name, s in series.items()
            if history.get(name)}


def adam_bound(beta1, beta2):
    """The most one Adam step can move a weight, in units of its learning rate (before weight decay): by
    Cauchy-Schwarz, |m_hat| / sqrt(v_hat) <= (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2)) whatever the
    gradients (clipped or not) and the step (with a = beta1^t, b = beta2^t, the bias corrections only lower it:
    (1 - b)(1 - a^2 / b) <= (1 - a)^2 as b + a^2 / b >= 2a); 7.3 at (0.9, 0.999), 1.2 at (0.9, 0.95); no bound
    when beta1^2 >= beta2."""
    if beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


@torch.no_grad()
def corrupted_weights(guard, model, optimizer, iteration, then, payload):
    """(DP rank, evidence) when some rank holds a weight the optimizer cannot have written since the snapshot of
    iteration `then`, else None. A weight may move by at most 2 x (sum of the LRs applied since) x (adam_bound +
    weight decay x |weight|), plus the rounding of its dtype; one that moved farther (or is not finite) was written
    by something else: a bit flipped in memory. One all-reduce over all ranks of one number per DP rank, so every
    rank names the same DP rank (the corrupted weight may be on any TP or PP rank of it)."""
    cfg, g, stats = guard.cfg, parallel.grid, snapshot_stats(payload)
    if "lr sum" not in stats:  # a checkpoint written before the guard summed its LRs: no bound to test against
        return None
    lr_sum = max(guard.lr_sum - stats["lr sum"], 0.0)
    steps = max(iteration - 1 - then, 1)
    decay = max([group.get("weight_decay", 0.0) for group in optimizer.param_groups] or [0.0])
    move = 2 * lr_sum * adam_bound(cfg.adam_beta1, cfg.adam_beta2)
    worst, where, chunk = 0.0, None, 2**24  # elements compared at a time: a few fp32 temporaries of 64 MiB
    for name, p in parallel.unwrap(model).named_parameters():
        if name not in payload[0] or not math.isfinite(move):
            continue
        for k in range(0, p.numel(), chunk):
            before = payload[0][name].view(-1)[k:k + chunk].to(p.device, torch.float32)
            now = p.detach().view(-1)[k:k + chunk].float()
            allowed = (move + 2 * max(lr_sum, steps) * decay * before.abs() + 4 * torch.finfo(p.dtype).eps
                       * (before.abs() + move) + torch.finfo(torch.float32).tiny)
            ratio = torch.where(torch.isfinite(now), (now - before).abs() / allowed, math.inf)
            i = int(ratio.argmax())
            if ratio[i] > worst:
                worst, where = float(ratio[i]), (name, k + i, float(before[i]), float(now[i]))
    ratios = torch.zeros(g.dp_size, dtype=torch.float64, device=next(model.parameters()).device)
    ratios[g.dp_rank] = worst
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ratios, op=dist.ReduceOp.MAX)
    ratios = ratios.tolist()
    if max(ratios) <= 1:
        return None
    rank = max(range(g.dp_size), key=ratios.__getitem__)
    if where is not None and worst > 1:  # the rank that holds it says which weight
        name, i, before, now = where
        print(f"spike guard: iteration {iteration}: on rank {g.rank}, weight {name}[{i}] is {now:.4g}, was "
              f"{before:.4g} at iteration {then}", flush=True)
    return rank, (f"a weight of DP rank {rank} moved {ratios[rank]:.3g}x farther since iteration {then} than Adam "
                  f"can move it at the LRs applied since (summed: {lr_sum:.3g}): written by something else")


def replay_in_fp32(guard, rng_before, model, optimizer, rerun):
    """The step replayed in fp32 (Fp32Step: the master weights, fp32 gradients, no loss scale), judged
    against the trend. Applied if it is ordinary; else the half-precision run is left exactly as it was (its
    weights, masters, optimizer, loss scaler and RNG streams, and the reason the guard gives)."""
    rng_after, pending = checkpoint.rng_state(), guard.pending
    checkpoint.set_rng_state(rng_before)
    with Fp32Step(model, optimizer) as fp32:
        exact = rerun(guard.judge if guard.armed() else None, optim.LossScaler(dynamic=False, static_scale=1.0))
        fp32.keep = exact.outcome == "ok"
    guard.pending = pending  # the spike's reason is the half-precision step's
    if not fp32.keep:
        checkpoint.set_rng_state(rng_after)
    return exact


class Fp32Step:
    """One step of a half-precision model run in fp32, for the spike guard's numerical diagnosis (a spike that an
    fp32 replay of the same step does not have, docs/spike_guard.md):

        with Fp32Step(model, optimizer) as fp32:
            step = train_step(model, optimizer, no_loss_scale, ...)
            fp32.keep = step.outcome == "ok"

    Inside, the model's weights are fp32 copies of its master weights and its gradients are accumulated in fp32
    (fp16: fp32 buckets in place of the GradBuffer's half ones; bf16's are fp32 already), so the forward,
    backward and optimizer step are those of an fp32 run from the same state. On leaving, with `keep`, the weights
    are the masters rounded into the half-precision tensors, as MixedPrecisionOptimizer.step rounds them;
    without, the half-precision tensors are back untouched, bit for bit. Costs, for that one step, an fp32 copy
    of the weights (fp16: and of the gradients), 4 (8) bytes per parameter, and activations at fp32's size."""

    def __init__(self, model, optimizer):
        self.gpt, self.optimizer, self.keep = parallel.unwrap(model), optimizer, False

    def __enter__(self):
        # fp32 means fp32: TF32 matmuls (Ampere on) keep a 10-bit mantissa, as little as fp16's
        self.tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        params = [p for p in self.gpt.parameters() if p.dtype != torch.float32]
        self.half = {p: p.data for p in params}
        for p, master in zip(params, master_weights(params, self.optimizer)):
            p.data = master
        buffer, self.buckets = parallel.grad_buffer(self.gpt), None
        if buffer is not None and buffer.buckets and buffer.buckets[0].dtype != torch.float32:
            self.buckets = (buffer, buffer.buckets, {p: p.main_grad for p in buffer.params})
            buffer.buckets = [torch.zeros_like(flat, dtype=torch.float32) for flat in buffer.buckets]
            for flat, members in zip(buffer.buckets, buffer.members):  # GradBuffer's layout, in fp32
                buffer.point(flat, members)
        return self

    @torch.no_grad()
    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32
        for p, half in self.half.items():
            if self.keep and exc[0] is None:
                half.copy_(p.data)
            p.data = half
        if self.buckets is not None:
            buffer, buffer.buckets, main_grads = self.buckets
            for p, grad in main_grads.items():
                p.main_grad = grad


@torch.no_grad()
def master_weights(params, optimizer):
    """Copies of the fp32 master weights of these model parameters, on this rank; under ZeRO-1 each broadcast over
    DP by the rank that holds it, as ZeroShardedOptimizer.step broadcasts the weights it updated."""
    copies = []
    for p in params:
        main = optimizer.main_param(p)
        if main is None:  # another DP rank's (ZeRO-1): broadcast below
            main = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        copies.append(main.detach().clone())
    if isinstance(optimizer, parallel.ZeroShardedOptimizer):
        optimizer.broadcast(dict(zip(params, copies)))
    return copies


@torch.no_grad()
def evaluate_batches(model, batches, cfg, device):
    """The mean loss of these micro-batches in train mode (dropout on, as in the trend it is compared with: eval
    mode would bias it low); the caller restores the RNG streams the dropout draws from."""
    return parallel.average_loss(training.forward_backward(model, batches, cfg, device, forward_only=True)).item()


# -----------------------------------------------------------------------------
# Naming the input behind a spike


@torch.no_grad()
def sample_losses(model, batches, cfg):
    """The loss of each sample of this global batch (in global batch order), one forward without dropout, with the
    run's packed-document inputs and loss mask (loader.packing) as its training sees them; all ranks take part
    (PP=1 only: a pipeline returns no per-sample losses)."""
    g, mbs, packing = parallel.grid, cfg.micro_batch_size, loader.packing(cfg)
    device = batches[0][0].device
    losses = torch.zeros(len(batches) * mbs * g.dp_size, device=device)
    was_training = model.training
    model.eval()
    for k, (x, y) in enumerate(batches):
        inputs = packing(x) if packing else {}
        mask = inputs.pop("loss_mask", None)
        per_token = parallel.vocab_parallel_cross_entropy(model(x, **inputs), y, cfg.vocab_size)[0].float()
        per_sample = per_token.mean(dim=1) if mask is None else (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        start = k * mbs * g.dp_size + g.dp_rank * mbs
        losses[start:start + mbs] = per_sample
    model.train(was_training)
    if g.dp_group is not None and g.dp_size > 1:
        dist.all_reduce(losses, group=g.dp_group)  # each sample's slot is filled by one DP rank
    return losses


def highest_loss_samples(model, batches, first_sample, cfg, count=3, positions=None):
    """[(loss, sample index)] of the `count` samples with the highest loss in this global batch (or of those at
    `positions` in it: a minority the diagnosis found, low losses included)."""
    losses = sample_losses(model, batches, cfg)
    if positions:
        return [(float(losses[i]), first_sample + i) for i in positions]
    top = torch.topk(losses, min(count, losses.numel()))
    return [(loss, first_sample + i) for loss, i in zip(top.values.tolist(), top.indices.tolist())]


SKIP_LIST = "skip_documents.jsonl"  # in save: the documents of the samples behind data-driven spikes


def name_samples(model, batches, first_sample, cfg, dataset, seqlen, iteration, decision=None):
    """Print (and return) the highest-loss samples of a spiking batch, decoded. When the diagnosis says the data
    did it (decision's cause "data"), their documents go to the skip list SAVE/skip_documents.jsonl too
    (skip_list.py's format), which skip_documents=FILE makes the data leave out."""
    import os

    import data
    if parallel.grid.pp_size > 1:
        print0(f"spike guard: iteration {iteration}: samples {first_sample}-{first_sample + cfg.global_batch_size - 1}"
            " (not ranked by loss with pipeline parallelism; tools/show_samples.py decodes them)")
        return []
    named = highest_loss_samples(model, batches, first_sample, cfg, positions=(decision or {}).get("suspects"))
    records = []
    for loss, index in named:
        print0(f"spike guard: iteration {iteration}: sample {index} (loss {loss:.3f}): "
            f"{data.sample_text(dataset, index, seqlen, 160, cfg.tokenizer_file)!r}")
        prefix, component, pieces = skip_list.sample_documents(dataset, index, seqlen + 1)
        records.append({"iteration": iteration, "sample": index, "loss": round(loss, 4), "dataset": prefix,
                        "dataset_index": component, "documents": [d for d, _ in pieces],
                        "tokens": [n for _, n in pieces]})
    if (decision or {}).get("cause") == "data" and cfg.save and records:
        path = os.path.join(cfg.save, SKIP_LIST)
        if parallel.grid.rank == 0:
            skip_list.append(path, records)
        by_dataset = {}
        for r in records:
            ids = by_dataset.setdefault(r["dataset"], [])
            ids += [d for d in r["documents"] if d not in ids]
        docs = "; ".join(f"{prefix}: {', '.join(map(str, ids))}" for prefix, ids in by_dataset.items())
        print0(f"spike guard: iteration {iteration}: the documents of these samples ({docs}) appended to the skip "
               f"list {path}; to train without them, set skip_documents={path} (a new run, or a resume from a "
               "checkpoint before the spike)")
    return named


# -----------------------------------------------------------------------------
# Warning before the spike: the precursor rung (docs/spike_guard.md, section 7)

# What the telemetry shows before a divergence (Wortsman et al. 2023; lessons 1, 20): each precursor is one
# number from a telemetry record (telemetry.Telemetry.finish()) and Adam's eps, and the side that warns.
PRECURSORS = {
    "attention_logit_max": (lambda t, eps: max(t["attention logit max"]), "high"),  # attention-logit growth
    "attention_entropy_min": (lambda t, eps: min(t["attention entropy min"]), "low"),  # entropy collapse
    "log_z": (lambda t, eps: t["log z"], "high"),  # the output logits' drift (what z-loss holds)
    "update_param_ratio": (lambda t, eps: max(t["update/param rms"]), "high"),
    "grad_rms_over_eps": (lambda t, eps: min(t["grad rms"]) / eps, "low"),  # updates shrink as it nears 1
    "final_ln_input_rms": (lambda t, eps: t["final layernorm input rms"], "high"),
}


def precursor_value(name, telemetry, eps):
    return float(PRECURSORS[name][0](telemetry, eps))


def past(name, value, threshold):
    """Is the precursor's value on the warning side of the threshold? A NaN is past any threshold."""
    if not math.isfinite(value):
        return True
    return value > threshold if PRECURSORS[name][1] == "high" else value < threshold


def precursor_rung(guard, cfg, iteration, telemetry):
    """The early rung (`spike_guard_precursor`, off by default), called with each telemetry record: when the
    precursor passes `spike_guard_precursor_threshold`, multiply the LR by `spike_guard_precursor_lr_factor` from
    the next iteration on, through guard.lr_scale (the factor a relapse uses; checkpoints keep it). Once per
    crossing: the rung is armed again when the precursor is back on the safe side. It sees only the iterations
    telemetry records (every telemetry_interval), whose numbers are reduced over all ranks: every rank decides
    alike. Its state is its entries in guard.decisions (kept by checkpoints, never rolled back), so a resumed run
    neither repeats nor forgets a cut. Returns the decision (also one `spike guard:` line) or None."""
    name, threshold = cfg.spike_guard_precursor, cfg.spike_guard_precursor_threshold
    if name is None:
        return None
    value = precursor_value(name, telemetry, cfg.adam_eps)
    mine = [d for d in guard.decisions if d["action"] in ("precursor", "precursor rearmed")]
    armed = not mine or mine[-1]["action"] == "precursor rearmed"
    crossed = past(name, value, threshold)
    high = PRECURSORS[name][1] == "high"
    if not armed and not crossed:
        reason = f"{name} {value:.4g} is back {'under' if high else 'over'} its threshold {threshold:g}"
        decision = guard._decide(iteration, "precursor rearmed", reason, "the precursor rung is armed again")
    elif armed and crossed:
        guard.lr_scale *= cfg.spike_guard_precursor_lr_factor
        reason = f"{name} {value:.4g} is {'over' if high else 'under'} its threshold {threshold:g}"
        decision = guard._decide(iteration, "precursor", reason, f"warning before a spike: LR x{guard.lr_scale:g} "
                                 "from the next iteration on", lr_scale=guard.lr_scale, value=value)
    else:  # armed and on the safe side, or already acted on this crossing
        return None
    guard.decisions.append(decision)
    return decision
