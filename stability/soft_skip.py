"""metaseq's soft skip (soft_skip_loss_ratio): a step whose loss is above that ratio x its trend is taken with
less weight -- its gradients scaled by trend / loss before clipping -- rather than skipped (docs/levers.md)."""
import training
from report import print0
from stability.config import SoftSkipConfig, section
from stability.detector import Series


class SoftSkip(training.Callback):
    """The step's update_factor: trend / loss for a loss above soft_skip_loss_ratio x its trend, else 1. The trend
    is read from the run state's history before each step; `trend`: a fixed one (a step outside a run)."""
    name = "soft_skip"

    def __init__(self, cfg, shared=None, trend=None):
        self.settings, self.trend = section(SoftSkipConfig, cfg), trend

    def start(self, parts, report, train_data):
        self.history = parts.state.history

    def before_step(self, it):
        self.trend = soft_skip_trend(self.settings, self.history)

    def update_factor(self, loss, grad_norm):
        if self.trend is not None and loss > self.settings.soft_skip_loss_ratio * self.trend:
            shrink = self.trend / loss
            print0(f"soft skip: loss {loss:.4g} is {loss / self.trend:.2f}x its trend's {self.trend:.4g}: gradients "
                   f"x {shrink:.3g}")
            return shrink
        return 1.0


def soft_skip_trend(settings, history):
    """The loss's trend for the soft skip (soft_skip_loss_ratio): the guard's line through the last applied losses
    (the run state's history: kept with the guard on or off), once spike_guard_min_steps are recorded; else None.
    settings: a SoftSkipConfig (or the run's config)."""
    if not settings.soft_skip_loss_ratio or len(history["loss"]) < settings.spike_guard_min_steps:
        return None
    # the line's next point needs the last values alone: loading them (Series.load) would judge each of the
    # history's 1,024 values again, every step
    losses = Series(settings.spike_guard_window)
    losses.values.extend(history["loss"][-Series.FIT:])
    trend = losses.expected()
    return trend if trend > 0 else None  # a line through a fast fall can cross zero: no ratio to speak of
