"""The spike guard's detector: is this step a spike? (docs/spike_guard.md, section 1; lesson 21)

A step's loss is a spike when it lands more than `spike_guard_zscore` scatters above the line fitted to the last
16 applied losses and above `spike_guard_ema_ratio` x that line's value (the scatter: the line's past prediction
errors, Series); its grad norm (its logarithm) the same and above `spike_guard_grad_norm_ratio` x; or the loss
half as far off its line, above or below (a degenerate batch the model finds easy), with an outlying grad norm,
or a whole bar below with the grad norm half as far up; or `spike_guard_rise_steps` losses in a row each half as
far above (a slow rise the line follows). It judges from `spike_guard_min_steps` applied steps on: the trend makes
the LR warm-up's falling loss and rising grad norm ordinary.

    detector = Detector(detector_cfg, clip_grad)  # a DetectorConfig, the core's clip_grad
    reason = detector.judge(loss, grad_norm)    # why this step is a spike, or None
    detector.record(loss, grad_norm, lr)        # an applied step

Its statistics (the recent losses and grad norms, the LRs applied) belong to the weights: checkpoints and
snapshots carry them and a rollback restores them. What a spike calls for is spike_guard.py's.
"""

import collections
import math
from dataclasses import dataclass

import run_state

# the words of a loss far below an unseen batch's (Detector.below_unseen)
LEARNT = "text learnt by heart"


class Series:
    """One watched number (the loss, or the logarithm of the grad norm), judged against its own trend.

    A z-score over a long window fails on a loss that is still falling fast: the window's spread is the fall
    itself, so a 50% jump can be under 6 std. Here a line is fitted to the last FIT applied values, and a step is
    judged by how far it lands above the line's next point, in units of the scatter: 1.4826 x the median of the
    line's past prediction errors (each value against the line fitted to the FIT values before it), robust to a
    spike that got through. The residuals around the line itself measure the scatter too, but over 16 points they
    are often small by chance: a clean 3,000-iteration run had a batch 3.4 noise widths above its trend called
    12 "spreads" (docs/spike_guard.md, section 9). Until FIT // 2 prediction errors exist (the first steps,
    whose fall a line of fewer points would misjudge) the residuals stand in; after, the larger of the two."""

    FIT = 16

    def __init__(self, window, log=False):
        self.log = log
        # applied steps (logarithms for the grad norm)
        self.values = collections.deque(maxlen=window)
        # |value - the line's prediction of it|, from FIT values on
        self.errors = collections.deque(maxlen=window)
        # each applied value's z when it was judged (rising())
        self.zs = collections.deque(maxlen=window)

    def transform(self, value):
        return math.log(max(value, 1e-30)) if self.log else float(value)

    def line(self):
        """(the next point of the line fitted to the last FIT values, the residuals' robust scatter), or None."""
        ys = list(self.values)[-self.FIT :]
        n = len(ys)
        if n < 2:
            return None
        xm, ym = (n - 1) / 2, sum(ys) / n
        slope = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum(
            (i - xm) ** 2 for i in range(n)
        )
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
        return scatters(x, p, s), math.exp(x - p) if self.log else (
            value / p if p > 0 else math.inf
        )

    def rising(self, z, steps, bar):
        """Whether a value judged z (judge()) and the last steps - 1 applied ones each landed more than `bar`
        scatters above their line's prediction: a rise the line follows (an LR too high), none of whose steps is a
        spike alone."""
        if len(self.errors) < self.FIT // 2 or len(self.zs) < steps - 1:
            return False
        return z > bar and all(past > bar for past in list(self.zs)[len(self.zs) - steps + 1 :])

    def shift_to(self, value):
        """The line moved so that its next point is this value: every kept value shifted alike (slope and scatter
        kept), the past zs cleared (a rise measured against the old level is no rise against the new one)."""
        found = self.fit()
        if found is None:
            return
        shift = self.transform(value) - found[0]
        shifted = [v + shift for v in self.values]
        self.values.clear()
        self.values.extend(shifted)
        self.zs.extend([0.0] * len(self.zs))

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


@dataclass
class DetectorConfig:  # Detector: what a spike is
    # -- stability: the spike guard's detector --
    # applied steps in the trailing loss / grad-norm statistics (OLMo-core: 128)
    spike_guard_window: int = 128
    # applied steps recorded before it judges (its own warm-up; the LR's need not end)
    spike_guard_min_steps: int = 16
    # a spike: loss or grad norm this many spreads above its trend's prediction ...
    spike_guard_zscore: float = 6.0
    spike_guard_ema_ratio: float = 1.1  # ... and above this multiple of the predicted value
    # ... or the grad norm this multiple (a clean tiny run: lone 12x jumps)
    spike_guard_grad_norm_ratio: float = 100.0
    # ... or the loss this many steps in a row over half that zscore (0: off)
    spike_guard_rise_steps: int = 3
    # ... or far below an unseen batch's loss, measured every N iters (0: off)
    spike_guard_unseen_interval: int = 10
    # the weights' move per update this x its trend, at each snapshot (0: off)
    spike_guard_update_ratio: float = 4.0

    # keys read only while a switch is on (sections.py): the soft skip's trend is the guard's line too
    SWITCHED = {
        "spike_guard|soft_skip_loss_ratio": ("spike_guard_window", "spike_guard_min_steps"),
        "spike_guard": (
            "spike_guard_zscore",
            "spike_guard_ema_ratio",
            "spike_guard_grad_norm_ratio",
            "spike_guard_rise_steps",
            "spike_guard_unseen_interval",
            "spike_guard_update_ratio",
        ),
    }


class Detector:
    """The trailing statistics of applied steps and the rules that call a step a spike (the module's docstring)."""

    Config = DetectorConfig  # its section: stability.build_callbacks builds it with it

    def __init__(self, detector_cfg, clip_grad):
        self.rules = detector_cfg  # a DetectorConfig
        self.clip_grad = clip_grad  # the grad norm's stand-in bar before it has a trend (0: none)
        window = detector_cfg.spike_guard_window
        self.series = {
            "loss": Series(window),
            "grad norm": Series(window, log=True),
            "update": Series(window, log=True),
        }  # the weights' move per update
        # the learning rates of the applied steps, summed: how far Adam can have moved a weight
        self.lr_sum = 0.0
        self.updates = 0  # the applied steps: how many updates a move between two states took
        # the loss of a batch never trained on, on recent weights (guard.Guard measures it)
        self.unseen = None
        # the last judged step was a spike of its grad norm alone (judge)
        self.grad_norm_alone = False

    def stats(self):
        return {
            **{name: series.state() for name, series in self.series.items()},
            "lr sum": self.lr_sum,
            "unseen": self.unseen,
            "updates": self.updates,
        }

    def load_stats(self, stats=None):
        """The statistics of a snapshot or checkpoint (None: one written without the guard, start afresh)."""
        for name, series in self.series.items():
            series.load((stats or {}).get(name))
        self.lr_sum = (stats or {}).get("lr sum", 0.0)
        self.updates = (stats or {}).get("updates", 0)
        self.unseen = (stats or {}).get("unseen")

    def record(self, loss, grad_norm, lr):
        """An applied step."""
        self.series["loss"].record(loss)
        self.series["grad norm"].record(grad_norm)
        self.lr_sum += lr
        self.updates += 1

    def rebase(self, loss, grad_norm):
        """A regime change: both trend lines moved to these numbers (Series.shift_to)."""
        self.series["loss"].shift_to(loss)
        self.series["grad norm"].shift_to(grad_norm)

    def ready(self):
        """Judging starts once spike_guard_min_steps applied steps are recorded (its own warm-up: the trend
        makes the LR warm-up's falling loss and rising grad norm ordinary)."""
        return len(self.series["loss"].values) >= self.rules.spike_guard_min_steps

    def judge(self, loss, grad_norm):
        """Why this step is a spike, or None: the first rule that calls it one, with its numbers."""
        judged = {
            "loss": self.series["loss"].judge(loss),
            "grad norm": self.series["grad norm"].judge(grad_norm),
        }
        reasons = self.outliers(loss, grad_norm, judged) + self.without_trend(grad_norm)
        # the grad norm's rules alone, the loss ordinary: what SpikeGuard.tolerates asks of the spike
        self.grad_norm_alone = bool(reasons) and not self.over("loss", judged)
        reasons = (
            reasons
            or self.joint_outlier(loss, grad_norm, judged)
            or self.slow_rise(loss, judged)
            or self.below_unseen(loss)
        )
        return "; ".join(reasons) or None

    def outliers(self, loss, grad_norm, judged):
        """The loss or the grad norm far above its own trend, each by its own bar."""
        reasons = []
        for name, value in (("loss", loss), ("grad norm", grad_norm)):
            series, (z, ratio) = self.series[name], judged[name]
            if self.over(name, judged):
                reasons.append(
                    f"{name} {value:.4g} is {ratio:.2f}x its trend's {series.expected():.4g}, {z:.1f} "
                    f"spreads above it"
                )
        return reasons

    def over(self, name, judged):
        """Whether the loss or the grad norm (judged: Series.judge's) is past its own bars."""
        r, (z, ratio) = self.rules, judged[name]
        bar = r.spike_guard_grad_norm_ratio if name == "grad norm" else r.spike_guard_ema_ratio
        return z > r.spike_guard_zscore and ratio > bar

    def without_trend(self, grad_norm):
        """fp16 while the loss scale searches: the losses are recorded, the grad norms are not (inf); until they
        have a trend, clip_grad stands in for it."""
        r = self.rules
        if (
            len(self.series["grad norm"].values) < 2
            and self.clip_grad
            and grad_norm > r.spike_guard_grad_norm_ratio * self.clip_grad
        ):
            return [
                f"grad norm {grad_norm:.4g} is {grad_norm / self.clip_grad:.2f}x clip_grad (no trend yet)"
            ]
        return []

    def joint_outlier(self, loss, grad_norm, judged):
        """A step that moved both: a loss off its trend by half the bar, on either side, with an outlying grad norm;
        or a loss a whole bar below its trend with a grad norm half the bar up. Above: the default run's LR x30 at
        60 (3.9 scatters of a fast fall's errors, grad norm 7.8); below: a degenerate batch the model finds easy
        (tr8-104B's backslash-only samples), which, met after a stretch of skipped ones, can come with a grad norm
        under its bar (the ninth campaign's trial 86: loss 41 scatters below, grad norm 11x its trend but 5.8
        scatters up). A loss a whole bar above is a spike alone (outliers); a grad-norm jump alone under its bar is
        a clean run's, and so is a loss alone below its line."""
        (z, ratio), (gz, gratio) = judged["loss"], judged["grad norm"]
        full, bar = self.rules.spike_guard_zscore, self.rules.spike_guard_ema_ratio
        half = full / 2
        above, below = z > half and ratio > bar, z < -half and ratio < 1 / bar
        # the loss half the bar off its line, the grad norm a whole bar up; or the loss a whole bar below, the
        # grad norm half the bar up
        moved = (above or below) and gz > full or below and z < -full and gz > half
        if moved and gratio > bar:
            return [
                f"loss {loss:.4g} is {ratio:.2f}x its trend's {self.series['loss'].expected():.4g}, "
                f"{abs(z):.1f} spreads {'above' if z > 0 else 'below'} it, with grad norm {grad_norm:.4g} "
                f"{gratio:.2f}x its trend's"
            ]
        return []

    def slow_rise(self, loss, judged):
        """A slow rise: the line tilts with it, so no step is a spike alone (an LR x37 from iteration 158 on, in the
        fault campaign of docs/spike_guard.md, section 9)."""
        steps, losses, half = (
            self.rules.spike_guard_rise_steps,
            self.series["loss"],
            self.rules.spike_guard_zscore / 2,
        )
        if steps and losses.rising(judged["loss"][0], steps, half):
            rise = ", ".join(f"{v:.4g}" for v in [*list(losses.values)[-(steps - 1) :], loss])
            return [
                f"loss rose {steps} steps in a row, each more than {half:g} spreads above its trend: {rise} "
                f"(trend now {losses.expected():.4g})"
            ]
        return []

    def below_unseen(self, loss):
        """A loss far below that of a batch these weights were never trained on (self.unseen): text learnt by heart.
        A block of repeated documents met in corpus order brings the loss down smoothly, and the line follows it: no
        step lands off its trend (the campaign's block fell 4.99 -> 1.06 in 99 iterations and none did), while a
        batch the run has not seen stays where the model really is. In a clean run the two are the same kind of
        batch, never seen, a batch's noise apart; a later epoch has seen both alike. Judged by the bar of a spike:
        zscore scatters of the loss's line below it, and under 1 / ema_ratio of it."""
        found = self.series["loss"].fit()
        if (
            self.unseen is None
            or found is None
            or not math.isfinite(loss)
            or not math.isfinite(self.unseen)
        ):
            return []
        z = (self.unseen - loss) / found[1] if found[1] > 0 else math.inf
        if (
            z > self.rules.spike_guard_zscore
            and loss * self.rules.spike_guard_ema_ratio < self.unseen
            and self.below_before(found[1])
        ):
            return [
                f"loss {loss:.4g} is {loss / self.unseen:.2f}x an unseen batch's {self.unseen:.4g} on these "
                f"weights, {z:.1f} spreads below it: {LEARNT}"
            ]
        return []

    def below_before(self, scatter):
        """Whether the spike_guard_rise_steps - 1 applied losses before this one lay below the unseen batch's too, each
        under 1 / ema_ratio of it and half the zscore scatters below (the stretch's own losses widen the scatter, as
        a slow rise's do: Detector.slow_rise): text learnt by heart is a stretch; one low batch is a clean run's (the
        fourth campaign's trial 43 had one at 0.89x, 6.5 scatters below, and none before it: docs/spike_guard.md,
        section 9). A block of repeated text keeps it: its first steps were applied, its later ones are not."""
        count = max(self.rules.spike_guard_rise_steps - 1, 0)
        before = list(self.series["loss"].values)[-count:] if count else []
        r = self.rules
        return all(
            self.unseen - v > r.spike_guard_zscore / 2 * scatter
            and v * r.spike_guard_ema_ratio < self.unseen
            for v in before
        )

    def moved(self, move):
        """Why the weights' move per update (relative to their norm, between two states: update_size.relative_move)
        is an outlier, or None: more than zscore scatters above its own trend's line and spike_guard_update_ratio x
        its value. The LR schedule moves it smoothly; an LR tens of times too high, or a corrupted optimizer state,
        by an order of magnitude, with or without a loss spike (the fourth campaign's LRs x13-x77 that no loss rule
        caught: docs/spike_guard.md, section 9). Judged from 3 readings on."""
        series, bar = self.series["update"], self.rules.spike_guard_update_ratio
        if not bar or len(series.values) < 3:
            return None
        z, ratio = series.judge(move)
        if z > self.rules.spike_guard_zscore and ratio > bar:
            return (
                f"the weights moved {move:.3g} of their norm per update, {ratio:.1f}x their trend's "
                f"{series.expected():.3g}, {z:.1f} spreads above it"
            )
        return None


def spikes_in(series, detector_cfg, clip_grad, stats=None):
    """The iterations of a recorded run [(iteration, loss, grad norm)] that the detector calls spikes, fed as a run
    feeds it (a spike is not recorded: its update is skipped), from `stats` (a snapshot's) or afresh."""
    detector = Detector(detector_cfg, clip_grad)
    detector.load_stats(stats)
    found = []
    for iteration, loss, grad_norm in series:
        if detector.ready() and detector.judge(loss, grad_norm):
            found.append(iteration)
        else:
            detector.record(loss, grad_norm, 0.0)
    return found


def run_stats(state):
    """The detector's statistics in a run state (a dict): the guard's own when it was on, else the run's history
    of applied steps (run_state.RunState.history, kept with the guard off too) in their form; {} for neither."""
    stats = (run_state.callback_states(state).get("spike_guard") or {}).get("stats")
    if stats:
        return stats
    history = state.get("history") or {}
    series = {"loss": Series(1), "grad norm": Series(1, log=True)}
    return {
        name: {"values": [s.transform(v) for v in history.get(name, [])]}
        for name, s in series.items()
        if history.get(name)
    }


def snapshot_stats(payload):
    """The detector's statistics in a snapshot's (or checkpoint's) run state (run_stats)."""
    return run_stats(payload[1]["state"])
