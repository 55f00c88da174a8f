"""The loss history: the loss and grad norm of the last HISTORY applied steps. The soft skip judges a
step against its trend (soft_skip.soft_skip_trend); the spike guard's statistics start from it on a
checkpoint that has none of its own (guard.Guard.load_state_dict). Kept by the part that needs it, in
its own state: checkpoints and snapshots carry it, a rollback returns it to the weights' iteration."""
import training

HISTORY = 1024  # applied steps kept: more than the guard's window (spike_guard_window) and its fit


class History(training.Callback):
    """The applied steps' numbers, oldest first: {"loss": [...], "grad norm": [...]} (`values`). An
    applied step is one whose update the core made (Step outcome "ok"); skipped, vetoed, NaN: none."""
    name = "history"

    def __init__(self, section_cfg=None, shared=None):  # no key of its own: built for its readers
        self.values = {"loss": [], "grad norm": []}

    def after_step(self, it, step):
        if step.outcome == "ok":
            for key, value in (("loss", step.loss), ("grad norm", step.grad_norm)):
                kept = self.values[key]
                kept.append(value)
                del kept[:-HISTORY]
        return False

    def state_dict(self):
        return {key: list(kept) for key, kept in self.values.items()}

    def load_state_dict(self, state, run, resume):  # a rollback's too: they go with the weights
        for key, kept in self.values.items():
            kept[:] = (state or {}).get(key, [])
