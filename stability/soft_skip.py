"""metaseq's soft skip (soft_skip_loss_ratio): a step whose loss is above that ratio x its trend is taken with
less weight -- its gradients scaled by trend / loss before clipping -- rather than skipped (docs/levers.md)."""

from dataclasses import dataclass

import training
from report import print0
from stability.detector import Series


@dataclass
class SoftSkipConfig:  # SoftSkip
    # -- stability: the soft skip --
    # loss > this x its trend: gradients x trend/loss before clipping (0: off)
    soft_skip_loss_ratio: float = 0.0


class SoftSkip(training.Callback):
    """The step's update_factor: trend / loss for a loss above soft_skip_loss_ratio x its trend, else 1. The trend
    is read from the run state's history before each step; `trend`: a fixed one (a step outside a run)."""

    Config = SoftSkipConfig  # its section: stability.build_callbacks builds it with it

    name = "soft_skip"

    def __init__(self, soft_skip_cfg, shared, min_steps, window, trend=None):
        """min_steps, window: spike_guard_min_steps, spike_guard_window: the guard's line's."""
        self.settings, self.min_steps, self.window, self.trend = (
            soft_skip_cfg,
            min_steps,
            window,
            trend,
        )

    def start(self, parts, report, train_data):
        self.history = parts.state.history

    def before_step(self, it):
        self.trend = soft_skip_trend(
            self.settings.soft_skip_loss_ratio, self.history, self.min_steps, self.window
        )

    def update_factor(self, loss, grad_norm):
        if self.trend is not None and loss > self.settings.soft_skip_loss_ratio * self.trend:
            shrink = self.trend / loss
            print0(
                f"soft skip: loss {loss:.4g} is {loss / self.trend:.2f}x its trend's {self.trend:.4g}: gradients "
                f"x {shrink:.3g}"
            )
            return shrink
        return 1.0


def soft_skip_trend(ratio, history, min_steps, window):
    """The loss's trend for the soft skip (soft_skip_loss_ratio): the guard's line through the last applied losses
    (the run state's history: kept with the guard on or off), once min_steps (spike_guard_min_steps)
    are recorded; else None. ratio: soft_skip_loss_ratio (0: off); window: spike_guard_window."""
    if not ratio or len(history["loss"]) < min_steps:
        return None
    # the line's next point needs the last values alone: loading them (Series.load) would judge each of the
    # history's 1,024 values again, every step
    losses = Series(window)
    losses.values.extend(history["loss"][-Series.FIT :])
    trend = losses.expected()
    # a line through a fast fall can cross zero: no ratio to speak of
    return trend if trend > 0 else None
