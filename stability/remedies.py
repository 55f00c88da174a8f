"""The field's own remedies for a loss spike, each written from its published definition, as baselines the spike
guard is compared with on the same faults (lab/guard_campaign.py --method; docs/spike_guard.md, "Baselines"). Each
is a callback switched by its own key, off by default, and judges the step's numbers before the update
(update_factor: DP rank 0's loss and grad norm on every rank, so every replica decides alike).

    SkipStep    OLMo-core's SkipStepOptimizer: skip a step whose loss or grad norm is > sigma stds above the mean of
                the previous 128 steps (skip_step_sigma)
    SpikyLoss   Megatron-LM's spiky-loss check (rerun state machine): a loss >= 10x the largest of the first 100
                seen is re-run to tell a transient fault from a reproducible one; the step then goes on
                (spiky_loss_factor)
    ZClip       ZClip's adaptive clipping: the grad norm's z-score against an EMA of its mean and variance; an
                outlier's gradients are clipped to a norm near that mean (zclip_z)

OPT/metaseq's rule (--skip-gradient-update-on-clip-norm: no update for a batch whose grad norm is above the clip
norm) is the core's skip_grad_norm_above (training.skip_reason): one implementation of each rule, so not here.

What these do not do, by their definitions: roll back, skip data, cut the LR or say why (SpikyLoss alone tells a
transient fault from a reproducible one). This file is not the guard and reads nothing of it.

The checkpoint restarts the field ran by hand, automated (CheckpointRestart): on a loss spike,
or a loss that is not finite, the run goes back to one of its own disk checkpoints and changes
its course, with no diagnosis:

    OptRestart  OPT-175B's: back to the last checkpoint before the spike, the LR x
                opt_restart_lr_factor from then on (Zhang et al. 2022, sec. 2.5; the seeds'
                OPT notes: "Lowered LR from 3e-4 -> 7.5e-5", x0.25)
    PalmRestart PaLM's: back to a checkpoint ~palm_restart_back (100) iterations before the
                spike, and skip palm_restart_skip (200-500) batches from there, "which cover the
                batches that were seen before and during the spike" (Chowdhery et al. 2022,
                sec. 5.1)
"""

import math
from dataclasses import dataclass

import checkpoint
import parallel
import run_state
import schedule
import training
from report import print0


def mean_std(values):
    """The mean and the sample standard deviation (Bessel's n - 1, as torch.std_mean) of a list of floats."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def skip_step_outliers(losses, grad_norms, sigma):
    """OLMo-core's rule (src/olmo_core/optim/skip_step_optimizer.py, SkipStepOptimizer.get_step_factor): the
    lists end with this step's value, after at least 2 before it (its warm-up: window // 2 values in all, and
    skip_step_window >= 6). A step is skipped when its loss, or its grad norm, minus the mean of the values
    before it is more than sigma of their standard deviations. Returns the outlying numbers, named (empty:
    apply)."""
    outliers = []
    for name, values in (("loss", losses), ("grad norm", grad_norms)):
        mean, std = mean_std(values[:-1])
        if values[-1] - mean > sigma * std:
            outliers.append(
                f"{name} {values[-1]:.4g} > mean {mean:.4g} + {sigma:g} x std {std:.3g}"
            )
    return outliers


@dataclass
class SkipStepConfig:  # SkipStep
    # -- stability: the field's remedies, baselines for the guard (docs/spike_guard.md) --
    # OLMo-core's SkipStep: skip a step > this many stds above the window (6; 0: off)
    skip_step_sigma: float = 0.0
    # ... the previous steps' losses and grad norms it is judged against (OLMo-core: 128)
    skip_step_window: int = 128

    SWITCHED = {"skip_step_sigma": ("skip_step_window",)}  # sections.py


class SkipStep(training.Callback):
    """OLMo-core's SkipStep: the last skip_step_window + 1 losses and grad norms; from skip_step_window // 2 of
    them on, a step whose loss or grad norm is more than skip_step_sigma standard deviations above the mean of the
    ones before it is skipped (vetoed). As in OLMo-core, a skipped step's numbers stay in the window (the optimizer
    records them before it decides); a NaN/inf step never reaches it here (the core skips it first), where in
    OLMo-core it would enter the statistics."""

    name = "skip_step"
    Config = SkipStepConfig  # its section: stability.build_callbacks builds it with it

    def __init__(self, skip_step_cfg, shared=None):
        self.settings = skip_step_cfg
        self.losses, self.grad_norms, self.iteration = [], [], None

    def before_step(self, it):
        self.iteration = it.number

    def update_factor(self, loss, grad_norm):
        keep = self.settings.skip_step_window + 1
        self.losses, self.grad_norms = (
            (self.losses + [loss])[-keep:],
            (self.grad_norms + [grad_norm])[-keep:],
        )
        if len(self.losses) < max(2, self.settings.skip_step_window // 2):  # its warm-up
            return 1.0
        outliers = skip_step_outliers(self.losses, self.grad_norms, self.settings.skip_step_sigma)
        if outliers:
            print0(f"remedy skip_step: iteration {self.iteration}: skipped: {'; '.join(outliers)}")
            return 0.0
        return 1.0

    def state_dict(self):
        return {"losses": self.losses, "grad norms": self.grad_norms}

    def load_state_dict(self, state, run, resume):
        state = state or {}
        self.losses, self.grad_norms = (
            list(state.get("losses", [])),
            list(state.get("grad norms", [])),
        )


def spiky_loss_check(state, loss, factor, samples):
    """Megatron-LM's RerunStateMachine.is_unexpectedly_large (megatron/core/rerun_state_machine.py), on a dict
    state {"count", "max"}: the first `samples` finite values set the largest |value| and are never flagged;
    from then on the largest is frozen and a value >= factor x it is flagged. NaN/inf are never flagged (checked
    separately). Returns True for a spike."""
    value = abs(loss)
    if not math.isfinite(value):
        return False
    if state["count"] < samples:
        state["count"] += 1
        state["max"] = max(state["max"], value)
        return False
    return value >= state["max"] * factor


@dataclass
class SpikyLossConfig:  # SpikyLoss
    # -- stability --
    # Megatron's spiky loss: a loss >= this x the largest seen is re-run (10; 0: off)
    spiky_loss_factor: float = 0.0
    # ... the first steps whose largest loss is the bar (Megatron: 100)
    spiky_loss_samples: int = 100

    SWITCHED = {"spiky_loss_factor": ("spiky_loss_samples",)}  # sections.py


class SpikyLoss(training.Callback):
    """Megatron-LM's spiky-loss check (--check-for-spiky-loss; pretrain_gpt.py: SPIKY_LOSS_FACTOR = 10,
    validate_result(..., tolerance=0.0, fatal=False)). Not checked on the process's first iteration (Megatron
    validates nothing before a first optimizer step). A flagged step is re-run in place (the same weights, batch
    and RNG streams) and its loss compared exactly: different, "not reproducible: possible transient error";
    equal, "reproducible" (Megatron would re-run it on another GPU from a checkpoint when fatal; not fatal, as for
    the spiky loss, it logs and continues). Either way the step is applied. Differences from Megatron: the step's
    DP-averaged loss is checked (Megatron: each rank's micro-batch loss sum; equal ratios at a fixed batch), and
    the re-run is a forward only whose gradients are not used (Megatron's re-run recomputes them)."""

    Config = SpikyLossConfig  # its section: stability.build_callbacks builds it with it

    name = "spiky_loss"

    def __init__(self, spiky_loss_cfg, shared):
        self.settings = spiky_loss_cfg
        self.state, self.first = {"count": 0, "max": 0.0}, True

    def start(self, parts, report, train_data):
        self.model, self.packing = parts.model, parts.rules.packing
        self.device = next(parallel.unwrap(parts.model).parameters()).device

    def before_step(self, it):
        self.it, self.rng = it, checkpoint.rng_state()  # the re-run starts where the step started

    def update_factor(self, loss, grad_norm):
        if self.first:
            self.first = False
            return 1.0
        if spiky_loss_check(
            self.state, loss, self.settings.spiky_loss_factor, self.settings.spiky_loss_samples
        ):
            again = self.rerun()
            verdict = (
                "reproducible (Megatron: correct result or application error; continuing)"
                if again == loss
                else f"not reproducible ({again:.6g}): possible transient error"
            )
            s = self.settings
            print0(
                f"remedy spiky_loss: iteration {self.it.number}: loss {loss:.4g} >= {s.spiky_loss_factor:g} x the "
                f"largest of the first {s.spiky_loss_samples} ({self.state['max']:.4g}): {verdict}"
            )
        return 1.0

    def rerun(self):
        """The step's loss again: the same batch on the same weights from the step's RNG state, nothing applied."""
        now = checkpoint.rng_state()
        checkpoint.set_rng_state(self.rng)
        loss = training.forward_backward(
            self.model, self.it.batches, self.packing, self.device, forward_only=True
        )
        loss = parallel.average_loss(loss).item()
        checkpoint.set_rng_state(now)
        return loss

    def state_dict(self):  # Megatron checkpoints large_value_counts and max_values with the run
        return dict(self.state)

    def load_state_dict(self, state, run, resume):
        self.state = {"count": 0, "max": 0.0, **(state or {})}


def zclip_threshold(state, grad_norm, z_thresh, alpha, warmup, eps=1e-6):
    """ZClip (Kumar et al. 2025, arXiv 2504.02507; github.com/bluorion-com/ZClip, zclip/zclip.py, its defaults:
    mode "zscore", clip_option "adaptive_scaling", clip_factor 1) on a dict state {"buffer", "mean", "var"}: the
    first `warmup` grad norms set the mean and (population) variance; then z = (g - mean) / (std + eps), and for
    z > z_thresh the norm is clipped to mean + z_thresh * std / (z / z_thresh). The EMA (mean first, then the
    variance around the new mean) takes the clipped norm, or g. Returns the clip norm, or None."""
    if state["mean"] is None:
        state["buffer"].append(grad_norm)
        if len(state["buffer"]) >= warmup:
            buffer = state["buffer"]
            state["mean"] = sum(buffer) / len(buffer)
            state["var"] = sum((x - state["mean"]) ** 2 for x in buffer) / len(buffer)
            state["buffer"] = []
        return None
    std = math.sqrt(state["var"])
    z = (grad_norm - state["mean"]) / (std + eps)
    clip = state["mean"] + z_thresh * std / (z / z_thresh) if z > z_thresh else None
    seen = clip if clip is not None else grad_norm
    state["mean"] = alpha * state["mean"] + (1 - alpha) * seen
    state["var"] = alpha * state["var"] + (1 - alpha) * (seen - state["mean"]) ** 2
    return clip


@dataclass
class ZClipConfig:  # ZClip
    # -- stability --
    # ZClip: clip a grad norm whose z-score over its EMA is above this (2.5; 0: off)
    zclip_z: float = 0.0
    zclip_alpha: float = 0.97  # ... the EMA's smoothing factor (ZClip: 0.97)
    zclip_warmup: int = 25  # ... grad norms collected before the EMA starts (ZClip: 25)

    SWITCHED = {"zclip_z": ("zclip_alpha", "zclip_warmup")}  # sections.py


class ZClip(training.Callback):
    """ZClip's adaptive gradient clipping (zclip_threshold): an outlying grad norm's gradients are scaled to the
    clip norm (x clip / (g + 1e-6), as ZClip's in-place clipping); the core's clip_grad still bounds every step,
    as ZClip's optional max_grad_norm (the smaller of the two wins in both)."""

    name = "zclip"

    Config = ZClipConfig  # its section: stability.build_callbacks builds it with it

    def __init__(self, zclip_cfg, shared=None):
        self.settings = zclip_cfg
        self.state, self.iteration = {"buffer": [], "mean": None, "var": None}, None

    def before_step(self, it):
        self.iteration = it.number

    def update_factor(self, loss, grad_norm):
        s = self.settings
        clip = zclip_threshold(self.state, grad_norm, s.zclip_z, s.zclip_alpha, s.zclip_warmup)
        if clip is None:
            return 1.0
        print0(
            f"remedy zclip: iteration {self.iteration}: clipped: grad norm {grad_norm:.4g} to {clip:.4g} "
            f"(EMA mean {self.state['mean']:.4g})"
        )
        return clip / (grad_norm + 1e-6)

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state, run, resume):
        self.state = {"buffer": [], "mean": None, "var": None, **(state or {})}
        self.state["buffer"] = list(self.state["buffer"])


# -----------------------------------------------------------------------------
# The checkpoint restarts: OPT's and PaLM's, automated


def loss_spike(losses, sigma):
    """The restarts' spike: OLMo-core's SkipStep rule on the loss alone (skip_step_outliers: the
    field's one published automatic spike rule, at its defaults 6 sigma over 128 steps, judged
    from 64 on). The list ends with this step's loss. Returns the words, or None."""
    found = skip_step_outliers(losses, losses, sigma)
    return found[0] if found else None


@dataclass
class RestartConfig:  # OptRestart, remedies.PalmRestart
    # -- stability --
    # the automated checkpoint restarts (remedies.OptRestart, PalmRestart; 0: off): on a spike,
    opt_restart_lr_factor: float = 0.0  # OPT's: back to the last checkpoint, the LR x this (0.25)
    palm_restart_skip: int = 0  # PaLM's: back palm_restart_back iterations, skip this many (200)
    palm_restart_back: int = 100  # ... to the newest checkpoint this far before the spike (PaLM)
    restart_sigma: float = 6.0  # their spike: the loss this many stds above the window's mean ...
    restart_window: int = 128  # ... of these previous steps (OLMo-core's SkipStep rule: 6, 128)
    restart_max: int = 3  # restarts in a run, then none (spike_guard_max_rollbacks' default)

    SWITCHED = {  # sections.py
        "palm_restart_skip": ("palm_restart_back",),
        "opt_restart_lr_factor|palm_restart_skip": (
            "restart_sigma",
            "restart_window",
            "restart_max",
        ),
    }


class CheckpointRestart(training.Callback):
    """A restart from the run's own disk checkpoints (save, every save_interval): what OPT and PaLM
    went back to, and where a 100B run's state lives (no host snapshots: those are the guard's).
    Snapshots.newest_before finds and reads them, as for the guard's disk rollbacks. A spike is
    loss_spike's (restart_sigma over restart_window losses), or a loss that is not finite (a
    divergence). The checkpoint restarted from is saved again at once, with the restart's
    decisions. At most restart_max restarts; then the run goes on without them, said once. No
    diagnosis: these are the baselines the guard is compared with. Its losses go with the
    weights; its decisions (the LR factor, the skip ranges, the decision log) are history, kept
    by checkpoints and never rolled back."""

    Config = RestartConfig  # its section: stability.build_callbacks builds it with it

    name = None

    def __init__(self, restart_cfg, shared):
        self.settings = restart_cfg
        self.writer, self.snapshots = shared.writer, shared.snapshots
        self.losses, self.spike = [], None
        self.lr_scale, self.skip_ranges, self.decisions = 1.0, [], []

    def start(self, parts, report, train_data):
        self.parts, self.report = parts, report

    def skip(self, iteration):
        return self.name if schedule.in_ranges(iteration, self.skip_ranges) else None

    def before_step(self, it):
        it.lr = it.lr * self.lr_scale
        self.spike = None

    def update_factor(self, loss, grad_norm):
        keep = self.settings.restart_window + 1
        self.losses = (self.losses + [loss])[-keep:]
        if len(self.losses) >= max(2, self.settings.restart_window // 2):  # OLMo-core's warm-up
            self.spike = loss_spike(self.losses, self.settings.restart_sigma)
        return 1.0  # a spiking step's update is undone by the restart

    def after_step(self, it, step):
        n = it.number
        diverged = None if math.isfinite(step.loss) else f"loss {step.loss} (a divergence)"
        reason = self.spike or diverged
        if reason is None:
            return False
        restarts = sum(d["action"] == "restart" for d in self.decisions)
        target = self.target(n) if restarts < self.settings.restart_max else None
        if target is None:  # said once: a diverged run would say it at every step
            if restarts >= self.settings.restart_max:
                self.decide_once(
                    n,
                    "cap",
                    reason,
                    f"no restart: restart_max="
                    f"{self.settings.restart_max} reached; the run goes on "
                    "without restarts",
                )
            else:
                self.decide_once(
                    n, "none", reason, f"no restart: no checkpoint before iteration {n} in save"
                )
            return False
        if self.writer is not None:
            self.writer.wait()  # the checkpoint to read may be the one being written
        restored, payload = self.snapshots.newest_before(target + 1)
        assert restored == target, (restored, target)
        # this callback's losses come back with the weights, its decisions stay (load_state_dict)
        run_state.restore(payload, self.parts)
        self.decide(n, "restart", reason, self.change(n, target), restored_iteration=target)
        # saved again with its decisions: `latest` names the restart, and a run killed now resumes
        # from it, not from a checkpoint of the abandoned timeline after it
        run_state.save(self.parts, self.writer)
        return True

    def target(self, n):
        """The iteration of the checkpoint to restart from (before the spike at n), or None."""
        before = [c for c in self.snapshots.checkpoints() if c < n]
        return max(before) if before else None

    def decide(self, n, action, reason, plan, **extra):
        decision = {"iteration": n, "action": action, "reason": reason, **extra}
        decision["line"] = f"remedy {self.name}: iteration {n}: {reason}: {plan}"
        print0(decision["line"])
        self.decisions.append(decision)
        self.report.record(n, {f"remedy {self.name}": [decision]})

    def decide_once(self, n, action, reason, plan):
        if not any(d["action"] == action for d in self.decisions):
            self.decide(n, action, reason, plan)

    def state_dict(self):
        return {
            "losses": list(self.losses),
            "lr_scale": self.lr_scale,
            "skip_ranges": [list(r) for r in self.skip_ranges],
            "decisions": list(self.decisions),
        }

    def load_state_dict(self, state, run, resume):
        state = state or {}
        self.losses = list(state.get("losses", []))
        if resume:  # a restart keeps the decisions: they are history
            self.lr_scale = state.get("lr_scale", 1.0)
            self.skip_ranges = [tuple(r) for r in state.get("skip_ranges", [])]
            self.decisions = list(state.get("decisions", []))


class OptRestart(CheckpointRestart):
    """OPT-175B's remedy automated: "When the loss diverged, we found that lowering the learning
    rate and restarting from an earlier checkpoint allowed for the job to recover" (Zhang et al.
    2022, sec. 2.5). Back to the last checkpoint before the spike, and the LR x
    opt_restart_lr_factor from there on, compounding at each restart; no data skipped. The
    factor: the one cut the seeds' OPT notes give a number for, 3e-4 to 7.5e-5 (x0.25)."""

    name = "opt_restart"

    def change(self, n, target):
        self.lr_scale *= self.settings.opt_restart_lr_factor
        return (
            f"restarted from the checkpoint of iteration {target}; LR x{self.lr_scale:.3g} "
            f"from iteration {target + 1} on; no data skipped"
        )


class PalmRestart(CheckpointRestart):
    """PaLM's remedy automated: "We re-started training from a checkpoint roughly 100 steps
    before the spike started, and skipped roughly 200-500 data batches, which cover the batches
    that were seen before and during the spike" (Chowdhery et al. 2022, sec. 5.1). Back to the
    newest checkpoint palm_restart_back or more iterations before the spike (none that far: the
    oldest before it), and palm_restart_skip iterations from there skipped, through the spike's
    own at least: drawn and thrown away, as skip_train_iteration_range does (lesson 9). The LR is
    unchanged."""

    name = "palm_restart"

    def target(self, n):
        before = [c for c in self.snapshots.checkpoints() if c < n]
        far = [c for c in before if c <= n - 1 - self.settings.palm_restart_back]
        return max(far) if far else min(before) if before else None

    def change(self, n, target):
        start, end = target + 1, max(target + self.settings.palm_restart_skip, n)
        self.skip_ranges.append((start, end))
        return (
            f"restarted from the checkpoint of iteration {target}; iterations {start}-{end} "
            f"skipped ({end - start + 1} batches); LR unchanged"
        )
