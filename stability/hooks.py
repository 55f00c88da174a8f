"""What the stability layer does at the training loop's named points (training.Callback), in one place.

    before_step    fault injection (a bad batch, an LR spike, a numerical fault, a bit flip armed), the guard's LR
                   factor, a telemetry probe started, the RNG and loss-scaler state a replay starts from
    on_grads       an injected gradient bit flip; the probe reads the gradients
    update_factor  the guard's judge (0: the update is skipped) and metaseq's soft skip (a loss above
                   soft_skip_loss_ratio x its trend scales the gradients by trend / loss)
    check_step     the probe's record and the precursor rung; a suspect step investigated (spike_guard.investigate:
                   replayed, its weights and batch tested) -- the step that stands is returned
    after_step     the guard's decision: recorded, and carried out (a rollback, or saving and stopping)
    after_iteration  a snapshot every spike_guard_snapshot_interval iterations

Every rank runs the same hooks on the same numbers (the step's are DP rank 0's on every replica: training.agree), so
the ranks cannot decide apart.
"""
import checkpoint
import loader
import parallel
import run_state
import training
from report import print0
from stability import skip_list, spike_guard, telemetry
from stability.faults import Faults
from stability.snapshots import Snapshots


class Veto(training.Callback):
    """A step's update_factor: the guard's judge(loss, grad norm), a reason to skip the update (0), and the soft
    skip: a loss above soft_skip_loss_ratio x its trend scales the gradients by trend / loss before clipping
    (metaseq's: the step is taken, with less weight). A replay's hooks are this alone (no fault, no probe)."""

    def __init__(self, cfg, judge=None, trend=None):
        self.cfg, self.judge, self.trend = cfg, judge, trend

    def update_factor(self, loss, grad_norm):
        if self.judge is not None and self.judge(loss, grad_norm):
            return 0.0
        if self.trend is not None and loss > self.cfg.soft_skip_loss_ratio * self.trend:
            shrink = self.trend / loss
            print0(f"soft skip: loss {loss:.4g} is {loss / self.trend:.2f}x its trend's {self.trend:.4g}: gradients "
                   f"x {shrink:.3g}")
            return shrink
        return 1.0


class StabilityHooks(training.Callback):
    name = "spike_guard"

    def __init__(self, cfg, writer=None):
        self.cfg, self.writer = cfg, writer
        # Its decisions (skip ranges, LR factor) hold whether or not the guard is on now (spike_guard=False).
        self.guard = spike_guard.SpikeGuard(cfg)
        self.faults = Faults(cfg)
        self.parts = self.report = self.snapshots = self.recorder = self.train_data = self.device = None

    # -- the run -------------------------------------------------------------------------------------------------

    def documents_to_skip(self, prefixes):
        if not self.cfg.skip_documents:
            return None
        print0(skip_list.summary(self.cfg.skip_documents, prefixes))
        return skip_list.read(self.cfg.skip_documents, prefixes)[0]

    def start(self, parts, report, train_data):
        self.parts, self.report, self.train_data = parts, report, train_data
        self.device = next(parallel.unwrap(parts.model).parameters()).device
        self.snapshots = Snapshots(self.cfg, parts.model)  # refuses snapshots that would not fit in the node's memory
        if self.cfg.telemetry_interval:
            self.recorder = telemetry.Telemetry(parts.model, self.cfg, parts.optimizer)

    def close(self):
        if self.snapshots is not None:
            self.snapshots.close()

    def state_dict(self):
        return self.guard.state_dict()

    def load_state_dict(self, state, run, resume):
        """At a resume, the guard's whole state; at a rollback, its statistics only (they go with the weights; its
        decisions are history). Without statistics of its own (a checkpoint of a run without the guard), the run
        state's (run_state.RunState) history of applied steps stands in for them."""
        if resume and state:
            self.guard.load_state_dict(state)
        self.guard.load_stats(spike_guard.run_stats({"spike_guard": state, "history": run.history}))

    # -- an iteration --------------------------------------------------------------------------------------------

    def skip(self, iteration):
        return "spike guard" if self.guard.skips(iteration) else None

    def before_step(self, it):
        cfg, guard, parts, n = self.cfg, self.guard, self.parts, it.number
        it.batches = self.faults.bad_batches(n, it.batches)
        it.batches = self.faults.degenerate_batches(n, it.batches)
        if cfg.inject_lr_persistent:  # a higher LR on every pass, as a resume with it: part of the schedule
            it.lr = it.lr * self.faults.lr_factor(n, guard)
        expected = it.lr * guard.lr_scale  # the LR a replay of this iteration would get
        it.lr = expected * (1.0 if cfg.inject_lr_persistent else self.faults.lr_factor(n, guard))
        if guard.enabled:
            guard.lrs = {k: v for k, v in guard.lrs.items() if n - k <= 2 * max(cfg.spike_guard_snapshot_interval, 1)}
            guard.lrs[n] = (expected, it.lr)
            if guard.noise is None and guard.armed():
                guard.noise = self.measure_noise(it)
        self.probe = self.recorder if self.recorder and n % cfg.telemetry_interval == 0 else None
        if self.probe:
            self.probe.begin()
        self.before = (checkpoint.rng_state(), parts.scaler.state_dict()) if guard.enabled else None
        self.numerical = self.faults.numerical(n, parts.model)
        self.flip_weight = self.faults.bitflip(n, guard, "weight")
        self.flip_grad = self.faults.bitflip(n, guard, "grad")
        self.veto = Veto(cfg, guard.judge if guard.armed() else None, soft_skip_trend(cfg, parts.state.history))

    def measure_noise(self, it):
        """The run's own nondeterminism, once, when the guard arms: the relative difference of the batch's loss
        and the loss of the same forward again, same RNG (0 on CPU; GPU kernels that use atomics differ)."""
        parts, rng = self.parts, checkpoint.rng_state()
        first = spike_guard.evaluate_batches(parts.model, it.batches, self.cfg, self.device)
        checkpoint.set_rng_state(rng)
        again = spike_guard.evaluate_batches(parts.model, it.batches, self.cfg, self.device)
        checkpoint.set_rng_state(rng)
        return abs(first - again) / max(abs(first), 1e-30)

    def counterfactual(self, it):
        """The last applied batch (drawn again from the data by its place: a resumed run asks the same one) on the
        weights of now, computed and not applied (the same RNG and loss scaler after as before): (Step, its
        iteration), or None before any applied step."""
        if self.guard.last_applied is None:
            return None
        parts, (iteration, first_sample, count, seqlen) = self.parts, self.guard.last_applied
        batches = loader.micro_batches(self.train_data, first_sample, count, self.cfg, seqlen, self.device)
        rng, scaler = checkpoint.rng_state(), parts.scaler.state_dict()
        step = training.train_step(parts.model, parts.optimizer, parts.scaler, batches, it.lr, self.cfg, self.device,
                                count_zeros=False, callbacks=Veto(self.cfg, lambda *numbers: "never applied"))
        checkpoint.set_rng_state(rng)
        parts.scaler.load_state_dict(scaler)
        return step, iteration

    def on_grads(self, model, loss_scale):
        if self.flip_grad is not None:
            self.flip_grad(model)
        if self.probe:
            self.probe.grads(loss_scale)

    def update_factor(self, loss, grad_norm):
        return self.veto.update_factor(loss, grad_norm)

    def after_update(self):
        if self.probe:
            self.probe.updated()

    def check_step(self, it, step):
        cfg, guard, parts, n = self.cfg, self.guard, self.parts, it.number
        if self.probe:
            stats = self.probe.finish()
            self.report.scalars(telemetry.scalars(stats), n, parts.state)
            self.report.record(n, {"telemetry": stats})
            # the precursor rung (off by default): sees telemetry iterations only; cuts the LR from the next
            warning = spike_guard.precursor_rung(guard, cfg, n, stats)
            if warning is not None:
                self.report.record(n, {"spike guard": [warning]})
        self.diagnosis = None
        if guard.enabled and step.outcome in spike_guard.SUSPECT:  # replay it, test its batch (forensics)
            def rerun(judge, scaler=parts.scaler):
                return training.train_step(parts.model, parts.optimizer, scaler, it.batches, it.lr, cfg, self.device,
                                        count_zeros=False, callbacks=Veto(cfg, judge))
            per_sample = None
            if parallel.grid.pp_size == 1:
                def per_sample():
                    return spike_guard.sample_losses(parts.model, it.batches, cfg).tolist()
            step, self.diagnosis = spike_guard.investigate(
                guard, parts, step, n, self.before, self.snapshots, rerun=rerun,
                forward=lambda: spike_guard.evaluate_batches(parts.model, it.batches, cfg, self.device),
                other=lambda: self.counterfactual(it), per_sample=per_sample)
        if self.numerical is not None:
            self.numerical.remove()
        if self.flip_weight is not None and step.outcome == "ok":
            self.flip_weight(parts.model)
        return step

    def after_step(self, it, step):
        cfg, guard, parts, n = self.cfg, self.guard, self.parts, it.number
        decision = guard.update(n, step.outcome, step.loss, step.grad_norm, parts.scaler, self.diagnosis, lr=it.lr)
        if step.outcome == "ok" and guard.enabled:
            guard.last_applied = [n, it.first_sample, len(it.batches), it.seqlen]
        if decision is None:
            return False
        if decision.get("cause") in (None, "data", "optimizer"):  # name the batch
            decision["samples"] = spike_guard.name_samples(parts.model, it.batches, it.first_sample, cfg,
                                                           self.train_data, it.seqlen, n, decision)
        self.report.record(n, {"spike guard": [decision]})
        if decision["action"] not in ("rollback", "stop"):
            return False
        if self.writer is not None:
            self.writer.wait()  # a rollback may read the checkpoint being written
        if self.snapshots.roll_back(decision, parts, guard) is None or decision["action"] == "stop":
            if cfg.save:
                run_state.save(parts, self.writer)
            self.report.close()
            self.snapshots.close()
            raise spike_guard.SpikeGuardStop(
                decision["line"] + "; saved and stopped: look at the samples named above, then resume with the "
                "caps raised or other settings")
        return True

    def after_iteration(self, iteration):
        self.snapshots.maybe_take(iteration, self.parts)


def soft_skip_trend(cfg, history):
    """The loss's trend for the soft skip (soft_skip_loss_ratio): the guard's line through the last applied losses
    (the run state's history: kept with the guard on or off), once spike_guard_min_steps are recorded; else None."""
    if not cfg.soft_skip_loss_ratio or len(history["loss"]) < cfg.spike_guard_min_steps:
        return None
    # the line's next point needs the last values alone: loading them (Series.load) would judge each of the
    # history's 1,024 values again, every step
    losses = spike_guard.Series(cfg.spike_guard_window)
    losses.values.extend(history["loss"][-spike_guard.Series.FIT:])
    trend = losses.expected()
    return trend if trend > 0 else None  # a line through a fast fall can cross zero: no ratio to speak of
