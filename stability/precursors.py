"""The precursors of a divergence the telemetry shows (Wortsman et al. 2023; lessons 1, 20): each one number read
from a telemetry record (telemetry.Telemetry.finish()) and Adam's eps, and the side on which it warns. The spike
guard's early rung (spike_guard.precursor_rung) and tools/precursors.py read them; config.py checks the name."""

import math

PRECURSORS = {
    "attention_logit_max": (
        lambda t, eps: max(t["attention logit max"]),
        "high",
    ),  # attention-logit growth
    "attention_entropy_min": (
        lambda t, eps: min(t["attention entropy min"]),
        "low",
    ),  # entropy collapse
    "log_z": (lambda t, eps: t["log z"], "high"),  # the output logits' drift (what z-loss holds)
    "update_param_ratio": (lambda t, eps: max(t["update/param rms"]), "high"),
    "grad_rms_over_eps": (
        lambda t, eps: min(t["grad rms"]) / eps,
        "low",
    ),  # updates shrink as it nears 1
    "final_ln_input_rms": (lambda t, eps: t["final layernorm input rms"], "high"),
}


def value(name, telemetry, eps):
    """The precursor's number in a telemetry record."""
    return float(PRECURSORS[name][0](telemetry, eps))


def past(name, value, threshold):
    """Is the precursor's value on the warning side of the threshold? A NaN is past any threshold."""
    if not math.isfinite(value):
        return True
    return value > threshold if PRECURSORS[name][1] == "high" else value < threshold
