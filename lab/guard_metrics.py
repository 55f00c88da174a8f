"""The seventh campaign's metrics (lab/campaign_report.py; docs/spike_guard.md, "The seventh
campaign's design"): metrics that a skip or a clip can win as well as a rollback, each over trials,
from the records alone.

    primary    the share of the unremedied twin's damage that a method removed, per trial:
               damage = final loss - the clean twin's (of the unremedied run), removed =
               (unremedied - remedied) / damage; 1 is the clean twin's loss, 0 doing nothing, below
               0 worse than doing nothing. Its mean over the trials whose unremedied run is harmful
               by its loss, with a percentile bootstrap interval over those trials.
    replicas   apart from the loss: of the trials whose unremedied run ended with its DP replicas
               apart, those whose remedied run ended with them equal.
    detection  an action within DETECT_WINDOW iterations from the fault's first, net of the
               method's clean-run base rate: how often its clean runs act within such a window from
               the same iterations.
    costs      iterations run (a rollback's replays count) and wall time over the unremedied
               twin's, snapshots held (copies of the run's state in host memory), actions and stops
               on harmless faults.

A run that did not finish (it died, or the guard stopped it) has no final loss: it is scored as an
untrained model, ln(vocabulary) (LOSS_CAP), for a stop costs the run. The grad-norm skip's bound
(OPT/metaseq) is calibrated here too: the 99.9th percentile of the clean runs' grad norms after
their warm-up.
"""

import math
import random
import re

LOSS_CAP = math.log(512)  # an untrained model's loss on the campaign's 512-token vocabulary
DETECT_WINDOW = 20  # iterations from the fault's first within which an action is a detection
BOOTSTRAP = 10_000  # resamples of the trials
CALIBRATION = (
    99.9,
    50,
)  # grad_norm_skip's bound: this percentile of the clean grad norms after this iteration


def final_loss(record, cap=LOSS_CAP):
    """The run's final validation loss, or `cap` when it did not finish (died, stopped,
    non-finite)."""
    valid = record.get("valid", math.nan)
    return valid if record.get("exit") == 0 and math.isfinite(valid) else cap


def damage_removed(clean, unremedied, remedied, cap=LOSS_CAP):
    """The share of the unremedied run's damage (its final loss over the clean twin's) that the
    remedied run removed; None when the unremedied run did no damage to the loss."""
    damage = final_loss(unremedied, cap) - final_loss(clean, cap)
    if damage <= 0:
        return None
    return (final_loss(unremedied, cap) - final_loss(remedied, cap)) / damage


def bootstrap_mean(values, resamples=BOOTSTRAP, seed=0, level=0.95):
    """(mean, lo, hi): the mean of values and its percentile bootstrap interval, the trials
    resampled with replacement `resamples` times from a generator seeded by `seed` (a report rebuilt
    gives the same interval)."""
    if not values:
        return (math.nan, math.nan, math.nan)
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return (
        sum(values) / n,
        means[int(tail * resamples)],
        means[min(resamples - 1, int((1 - tail) * resamples))],
    )


def acted_within(record, start, window=DETECT_WINDOW):
    """Did the run act at an iteration in [start, start + window)? (each action's line names its
    iteration)"""
    return any(
        start <= int(re.search(r"iteration (\d+)", d)[1]) < start + window
        for d in record["decisions"]
    )


def base_rate(cleans, starts, window=DETECT_WINDOW):
    """The share of (clean run, start) pairs in which the clean run acted within the window from
    that start: how often the method would 'detect' a fault that is not there."""
    pairs = [acted_within(c, s, window) for c in cleans for s in starts]
    return sum(pairs) / len(pairs) if pairs else math.nan


def percentile(values, q):
    """The nearest-rank q-th percentile: the smallest value with at least q% of the values at or
    below it."""
    ordered = sorted(values)
    return ordered[
        max(0, math.ceil(round(q / 100 * len(ordered), 9)) - 1)
    ]  # 99.9% of 1000: 999, not 1000


def calibrated_bound(cleans, q=CALIBRATION[0], after=CALIBRATION[1]):
    """The grad-norm skip's bound: the q-th percentile of the finite grad norms of the clean runs'
    first passes after iteration `after` (a rollback's replays left out). OPT's bound was its clip
    norm, which a small model's clean run passes at most steps; calibrated, the rule skips ~0.1% of
    clean steps."""
    norms = []
    for record in cleans:
        first = {}
        for i, _, norm, _ in record["series"]:
            first.setdefault(i, norm)
        norms += [g for i, g in first.items() if i > after and math.isfinite(g)]
    if not norms:
        raise ValueError(
            f"no clean run has a grad norm after iteration {after}: run the clean twins first "
            "(the grad-norm skip's bound is calibrated on them)"
        )
    return percentile(norms, q)


def costs(remedied, unremedied):
    """(iterations run / the unremedied twin's - 1, wall time / the unremedied twin's - 1, snapshots
    held)."""
    steps = len(remedied["series"]) / max(len(unremedied["series"]), 1) - 1
    wall = (
        remedied.get("seconds", math.nan) / unremedied["seconds"] - 1
        if unremedied.get("seconds")
        else math.nan
    )
    return steps, wall, remedied.get("snapshots", 0)
