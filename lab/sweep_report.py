"""The stability lab's numbers (lab/lr_sweep.py's docstring has the study): a run's metrics read and summarized,
the blow-up and LR-sensitivity criteria, the tracked records (lab/results.jsonl), the tables, the figure and the
sections of lab/stability.md and lab/natural.md that --report --docs writes. It reads what runs wrote; it runs
nothing.
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import files  # noqa: E402
import report  # noqa: E402
from sweep_arms import (  # noqa: E402
    ARMS,
    HALF_DECADES,
    LADDER,
    VOCAB_SIZE,
    WIDTH,
    counted_elsewhere,
    in_selection,
    seeds_at,
    width_of,
    with_same_runs,
)

L0 = math.log(VOCAB_SIZE)


# Wortsman et al. 3.1: past it, attention collapses and the loss diverges
ATTENTION_LOGIT_BLOWUP = 1e4


# From the pilot (lab/stability.md): arm A's default at LR 1e-2 trains below the bigram entropy from here on
BLOWUP_FROM = 440


# "clearly below" the bigram entropy, in nats: a perplexity 18% lower than the bigram model's
PILOT_MARGIN = 0.2


# The LR sensitivity is reported over two ranges: the arm's whole grid, and 1e-3..3e-1, taken as Wortsman et al.'s
# range at this scale (the grid less LR 1, where every lever set breaks). They differ: a point where
# both lever sets fail adds to both, and weighs 1/7 of the mean.
WORTSMAN_RANGE = (1e-3, 3e-1)


SENSITIVITY_RANGES = {"grid": (0.0, math.inf), "1e-3..3e-1": WORTSMAN_RANGE}


# A remedy's stable LR range: the grid LRs, next to each other, whose seed-mean final loss is within this of the
# best run of the arm at that width, any lever set (the margin is the study's, stated before any run)
STABLE_MARGIN = 0.1


# A remedy's run worse than none's twin (the same LR and seed) by more than this is listed by name: the margin of
# the registration's predictions 2-4, 7 and 8 (lab/natural.md), stated before any run
WORSE_MARGIN = 0.05


# -----------------------------------------------------------------------------
# One run's numbers


def read_metrics(path, upto=None):
    """What a run's metrics.jsonl says, up to iteration `upto` if given: per iteration of the timeline it ends on
    (report.read_metrics) the loss and grad norm, every telemetry record, the final validation loss. Returns a
    dict of series and the summaries of result.json."""
    records = {i: r for i, r in report.read_metrics(path).items() if upto is None or i <= upto}
    out = {
        "val_loss": None,
        "loss": [],
        "grad_norm": [],
        "nan_iterations": 0,
        "skipped_iterations": 0,
        "telemetry": [],
        "iterations": max(records, default=0),
    }
    for iteration, record in sorted(records.items()):
        if "validation lm loss" in record:
            out["val_loss"] = record["validation lm loss"]
        if "lm loss" in record:
            out["loss"].append(record["lm loss"])
            out["grad_norm"].append(record.get("grad norm"))
            out["nan_iterations"] += int(record.get("number of nan iterations", 0))
            out["skipped_iterations"] += int(record.get("number of skipped iterations", 0))
        if "telemetry" in record:
            out["telemetry"].append({"iteration": iteration, **record["telemetry"]})
    return out


def summarize_run(metrics, eps):
    """result.json's numbers from read_metrics(): final losses, the 10-iteration loss means, the telemetry's
    maxima and last values, the precursors' series, the spike score."""
    t = metrics["telemetry"]
    loss10 = [_mean(metrics["loss"][i : i + 10]) for i in range(0, len(metrics["loss"]), 10)]
    finite = [v for v in metrics["loss"] if v is not None and math.isfinite(v)]
    last = t[-1] if t else {}

    def peak(key, reduce=max):
        values = [reduce(r[key]) if isinstance(r[key], list) else r[key] for r in t if key in r]
        values = [v for v in values if v is not None and math.isfinite(v)]
        return max(values) if values else None

    return {
        "val_loss": metrics["val_loss"],
        "train_loss": loss10[-1] if loss10 else None,
        "train_loss_max": max(finite) if finite else None,
        "nan_iterations": metrics["nan_iterations"],
        "skipped_iterations": metrics["skipped_iterations"],
        "loss10": loss10,
        "spike_score": spike_score(metrics["grad_norm"]),
        "attention_logit_max": peak("attention logit max"),
        "log_z_max": peak("log z max"),
        "embedding_norm_max": peak("word embedding norm"),
        "final_ln_input_rms_max": peak("final layernorm input rms"),
        "attention_entropy_min": min(last["attention entropy min"]) if t else None,
        "log_z": last.get("log z"),
        "output_logit_mean": last.get("output logit mean"),
        "grad_rms_over_eps": min(last["grad rms"]) / eps if t else None,
        "series": {
            key: [r.get(name) if not isinstance(r.get(name), list) else reduce(r[name]) for r in t]
            for key, name, reduce in (
                ("iteration", "iteration", None),
                ("log_z", "log z", None),
                ("output_logit_mean", "output logit mean", None),
                ("attention_logit_max", "attention logit max", max),
                ("attention_entropy_min", "attention entropy min", min),
            )
        },
    }


def spike_score(values, window=100, sigmas=7.0):
    """OLMo 2's spike score: the share of the values at least `sigmas` standard deviations above the mean of the
    `window` values before them (OLMo 2 looks 1,000 back over runs of 10^5 steps; these are 500 long). A NaN or
    inf counts as a spike; None (a skipped iteration) is left out, and so is a finite value after a window of NaNs,
    which has nothing to be a spike against (a diverged run whose grad norm comes back finite)."""
    values = [v for v in values if v is not None]
    spikes = scored = 0
    for i in range(window, len(values)):
        if not math.isfinite(values[i]):
            spikes += 1
            scored += 1
            continue
        past = [v for v in values[i - window : i] if math.isfinite(v)]
        if not past:
            continue
        scored += 1
        mean = sum(past) / len(past)
        std = math.sqrt(sum((v - mean) ** 2 for v in past) / len(past))
        spikes += values[i] > mean + sigmas * std
    return spikes / scored if scored else None


# -----------------------------------------------------------------------------
# Summaries


def clipped(loss, l0=L0):
    """A final loss as the sensitivity counts it: a diverged run (NaN/inf or above L0) counts as L0."""
    return l0 if loss is None or not math.isfinite(loss) or loss > l0 else loss


def sensitivity(losses, l0=L0):
    """Wortsman et al.'s LR sensitivity of one curve {lr: final loss}: mean over the LR grid of
    min(L(lr), L0) - L*, with L* the curve's best loss (L0 if every run diverged)."""
    values = [clipped(loss, l0) for loss in losses.values()]
    best = min(values)
    return sum(v - best for v in values) / len(values)


def blew_up(result, bigram, start=BLOWUP_FROM, margin=PILOT_MARGIN, attention_logit=True):
    """A NaN, a training loss (10-iteration mean) above the bigram entropy after iteration `start`, having been
    clearly below it (by `margin`) before -- the run lost what it had learned (a slow run near the bigram entropy
    crosses it back and forth with the batches' noise: not a blow-up) -- or, with `attention_logit`, an attention
    logit above 1e4. An arm that tests the attention logits (ARMS' "logit_blows_up": False) counts them apart
    (`logit_past_1e4`): a criterion made of the variable under test would make its verdict circular."""
    if result.get("nan_iterations"):
        return True
    if attention_logit and (result.get("attention_logit_max") or 0) > ATTENTION_LOGIT_BLOWUP:
        return True
    # a tracked record (record()): the loss criterion as it was computed from the series
    if "loss10" not in result:
        return bool(result.get("lost_what_it_learned"))
    loss10 = [
        v if v is not None and math.isfinite(v) else math.inf for v in result.get("loss10", [])
    ]
    for i, value in enumerate(loss10):
        if (
            (i + 1) * 10 > start
            and value > bigram
            and min(loss10[:i], default=math.inf) < bigram - margin
        ):
            return True
    return False


def lowest_loss10(result):
    """A run's lowest 10-iteration training-loss mean: from its series, or as a tracked record keeps it."""
    if "loss10" in result:
        return min((v for v in result["loss10"] if v is not None), default=math.inf)
    low = result.get("loss10_min")
    return math.inf if low is None else low


def logit_past_1e4(result):
    return (result.get("attention_logit_max") or 0) > ATTENTION_LOGIT_BLOWUP


def complete_curves(by_key, lever_set, lrs):
    """{seed: {lr: final loss (clipped)}} of the seeds run at every LR of lrs: no run stands in for another, so a
    seed missing at one LR has no curve."""
    seeds = sorted({seed for (s, _, seed) in by_key if s == lever_set})
    return {
        seed: {lr: clipped(by_key[(lever_set, lr, seed)]["val_loss"]) for lr in lrs}
        for seed in seeds
        if all((lever_set, lr, seed) in by_key for lr in lrs)
    }


def sensitivities(by_key, lever_set, lrs):
    """The LR sensitivity over lrs: per seed with a complete curve ({seed: value}), and of the mean of those
    seeds' curves (None without one)."""
    # a range none of the selection's LRs is in
    curves = complete_curves(by_key, lever_set, lrs) if lrs else {}
    if not curves:
        return {}, None
    mean_curve = {lr: sum(c[lr] for c in curves.values()) / len(curves) for lr in lrs}
    return {seed: sensitivity(c) for seed, c in curves.items()}, sensitivity(mean_curve)


def stable_range(row, best, margin=STABLE_MARGIN):
    """The widest run of neighbouring grid LRs whose seed-mean final loss is within margin of best: (low LR,
    high LR, how many grid points), or None where no LR is."""
    lrs, runs, current = sorted(row["points"]), [], []
    for lr in lrs:
        if row["points"][lr]["mean"] <= best + margin:
            current.append(lr)
        else:
            runs, current = runs + [current], []
    widest = max([*runs, current], key=len)
    return (widest[0], widest[-1], len(widest)) if widest else None


def summarize(results, arm, lever_sets, lrs, bigram):
    """Per lever set of an arm: per LR the seeds run and their final losses (mean, min, max, n), how many blew up,
    passed an attention logit of 1e4, never got below the bigram entropy, diverged; the precursors (mean over
    seeds); the LR sensitivity over the arm's grid and over Wortsman et al.'s range (`ranges`: per seed whose
    curve is complete there, and of those seeds' mean curve). `sensitivity` and `sensitivity_seeds` are the
    grid's (None where no seed ran every LR of it)."""
    by_key = {
        (r["lever_set"], r["lr"], r["seed"]): r
        for r in results
        if r["arm"] == arm and "error" not in r
    }
    logit_blows_up = ARMS.get(arm, {}).get("logit_blows_up", True)
    rows = []
    for lever_set in lever_sets:
        points = {}
        for lr in lrs:
            runs = [r for (s, x, _), r in sorted(by_key.items()) if s == lever_set and x == lr]
            if not runs:
                continue
            values = [clipped(r["val_loss"]) for r in runs]
            points[lr] = {
                "mean": sum(values) / len(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
                "seeds": [r["seed"] for r in runs],
                "values": values,
                "diverged": sum(v == L0 for v in values),
                # stopped by the spike guard: L0 too
                "stopped": sum(r.get("stopped_at") is not None for r in runs),
                "blew_up": sum(blew_up(r, bigram, attention_logit=logit_blows_up) for r in runs),
                "logit_past_1e4": sum(logit_past_1e4(r) for r in runs),
                "never_below": sum(lowest_loss10(r) >= bigram for r in runs),
                # updates not applied, over the seeds; None where a record predates the count
                **{key: total_or_none([r.get(key) for r in runs]) for key in NO_UPDATE},
                "runs": {key: [r.get(key) for r in runs] for key in PRECURSORS},
                **{key: _mean([r.get(key) for r in runs]) for key in PRECURSORS},
            }
        if not points:
            continue
        ranges = {}
        for label, (low, high) in SENSITIVITY_RANGES.items():
            within = [lr for lr in lrs if low <= lr <= high]
            per_seed, of_mean = sensitivities(by_key, lever_set, within)
            ranges[label] = {"lrs": within, "seeds": per_seed, "mean_curve": of_mean}
        grid = ranges["grid"]["seeds"]
        mean_curve = {lr: p["mean"] for lr, p in points.items()}
        best_lr = min(mean_curve, key=mean_curve.get)
        rows.append(
            {
                "lever_set": lever_set,
                "points": points,
                "ranges": ranges,
                "sensitivity": ranges["grid"]["mean_curve"],
                "sensitivity_seeds": (min(grid.values()), max(grid.values()))
                if len(grid) > 1
                else None,
                "best_loss": mean_curve[best_lr],
                "best_lr": best_lr,
            }
        )
    return rows


# result.json's counts of the iterations that applied no update, shown per LR (the sum over seeds) for the arms
# that test remedies: the log's `number of skipped iterations` (an fp16 overflow, a non-finite grad norm, a
# callback's veto: SkipStep's, the guard's) and `number of nan iterations`
NO_UPDATE = ("skipped_iterations", "nan_iterations")


# result.json keys shown per LR (mean over seeds), with their table titles
PRECURSORS = {
    "attention_logit_max": "largest attention logit",
    "attention_entropy_min": "lowest head entropy",
    "log_z": "mean log Z at the end",
    "output_logit_mean": "mean output logit at the end",
    "grad_rms_over_eps": "lowest layer grad RMS / eps",
    "final_ln_input_rms_max": "largest RMS into ln_f",
    "spike_score": "spike score (grad norm)",
}


# -----------------------------------------------------------------------------
# The tracked results (lab/results.jsonl): one line a run, from which --report --results rebuilds the tables
# and the figure without the runs' directories (out/ is not tracked)


RECORD_KEYS = [
    "val_loss",
    "train_loss",
    "train_loss_max",
    "nan_iterations",
    "skipped_iterations",
    "cpu_seconds",
    *PRECURSORS,
    "log_z_max",
    "embedding_norm_max",
]


RECORD_ID = ("arm", "lever_set", "lr", "seed", "width", "code")


def _rounded(value):
    return float(f"{value:.7g}") if isinstance(value, float) and math.isfinite(value) else value


def record(result, corpus):
    """One finished run as a line of the tracked results: what the report reads of it -- final losses, the inputs
    of the blow-up, flat and divergence counts (the loss criterion as a flag, the lowest loss), the precursors, the
    arm, lever set, LR, seed, width, the code version it ran on and the corpus it was measured against -- and none
    of its per-iteration series."""
    out = {key: result[key] for key in ("arm", "lever_set", "lr", "seed")}
    out["width"] = result.get("width") or width_of(result.get("args", []))
    out["code"] = result.get("code", "unrecorded")
    out.update({key: _rounded(result.get(key)) for key in RECORD_KEYS})
    out["loss10_min"] = _rounded(lowest_loss10(result))
    if result.get("stopped_at") is not None:
        out["stopped_at"] = result["stopped_at"]
    if result.get("resumed_val_loss") is not None:
        out["resumed_val_loss"] = _rounded(result["resumed_val_loss"])
    out["lost_what_it_learned"] = blew_up(
        {"loss10": result.get("loss10", [])}, corpus["bigram_entropy"], attention_logit=False
    )
    out["corpus"] = {key: corpus[key] for key in ("tokens", "unigram_entropy", "bigram_entropy")}
    return out


def merge_records(path, records):
    """Add records to the file at path, one JSON line a run; a record replaces the line of the same run on the
    same code version (the same run's numbers read again), never one of another version."""
    kept = {
        tuple(r[k] for k in RECORD_ID): r
        for r in (load_records(path) if os.path.exists(path) else [])
    }
    kept.update({tuple(r[k] for k in RECORD_ID): r for r in records})
    with files.replaced(path) as tmp, open(tmp, "w") as f:
        for key in sorted(kept, key=lambda k: (k[5], k[4], k[0], k[1], k[2], k[3])):
            f.write(json.dumps(kept[key]) + "\n")


def load_records(path):
    """The runs of a file --record wrote; a line it did not write is refused, by its number."""
    with open(path) as f:
        numbered = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    records = []
    for number, line in numbered:
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"lr_sweep: {path}:{number} is not JSON ({e}); fix or remove the line"
            ) from None
        missing = [k for k in (*RECORD_ID, "val_loss", "corpus") if k not in r]
        if missing:
            raise SystemExit(
                f"lr_sweep: {path}:{number} lacks {', '.join(missing)}: not a line lr_sweep --record "
                "wrote; remove it, or record the run again from its directory"
            )
        records.append(r)
    return records


def one_code(results, chosen=None):
    """(results, code): the results of one code version -- `chosen`'s, or all when they are of one version. Runs of
    two versions are not put in one table: refused, naming the versions and their runs."""
    if chosen:
        results = [r for r in results if r.get("code") == chosen]
        if not results:
            raise SystemExit(f"lr_sweep: no run of the selection ran on code {chosen}")
    codes = {}
    for r in results:
        codes[r.get("code", "unrecorded")] = codes.get(r.get("code", "unrecorded"), 0) + 1
    if len(codes) > 1:
        raise SystemExit(
            "lr_sweep: the selection mixes runs of "
            + ", ".join(f"code {c} ({n} runs)" for c, n in sorted(codes.items()))
            + "; a table compares like with like: pass --code=<one of them>"
        )
    return results, next(iter(codes), None)


# -----------------------------------------------------------------------------
# The size ladder


def ladder(results, bigram, targets=(), lever_sets=("default", "qk_layernorm")):
    """The size ladder of arm A: per width, the LR at which the default's largest attention logit
    passes 1e4 and each lever set's LR sensitivity over Wortsman et al.'s range; and for every width past the two
    smallest run, both predicted from those two (a line in log width through them: log LR for the crossing, the
    sensitivity itself), `targets` included before they run. Widths are compared over the seeds run at every width
    (a mean over seeds 1-3 against seed 3 alone would be a seed effect read as a width effect). Returns {width:
    {"crossing": lr or None, "sensitivity": {lever set: value or None}, "n": runs, "seeds": [...], "predicted":
    {...} or absent}}."""
    results = [r for r in results if r["arm"] == "A"]
    widths = sorted({r["width"] for r in results})
    seeds = (
        sorted(set.intersection(*({r["seed"] for r in results if r["width"] == w} for w in widths)))
        if widths
        else []
    )
    results = [r for r in results if r["seed"] in seeds]
    out = {}
    for width in sorted({*widths, *targets}):
        runs = [r for r in results if r["width"] == width]
        rows = {
            row["lever_set"]: row
            for row in summarize(runs, "A", list(lever_sets), HALF_DECADES, bigram)
        }
        default = rows.get("default")
        out[width] = {
            "n": len(runs),
            "seeds": seeds,
            "crossing": logit_crossing(default["points"]) if default else None,
            "sensitivity": {
                lever: rows[lever]["ranges"]["1e-3..3e-1"]["mean_curve"] if lever in rows else None
                for lever in lever_sets
            },
        }
    if len(widths) >= 2:
        (w1, w2), log = widths[:2], math.log

        def through(y1, y2, w, transform=lambda v: v, back=lambda v: v):
            if y1 is None or y2 is None:
                return None
            slope = (transform(y2) - transform(y1)) / (log(w2) - log(w1))
            return back(transform(y1) + slope * (log(w) - log(w1)))

        for width in [w for w in out if w > w2]:
            out[width]["predicted"] = {
                "crossing": through(
                    out[w1]["crossing"], out[w2]["crossing"], width, math.log, math.exp
                ),
                "sensitivity": {
                    lever: through(
                        out[w1]["sensitivity"][lever], out[w2]["sensitivity"][lever], width
                    )
                    for lever in lever_sets
                },
                "from": (w1, w2),
            }
    return out


def logit_crossing(points):
    """The LR at which the largest attention logit (the geometric mean over the seeds run at an LR) passes 1e4,
    interpolated in log-log between the last grid LR below it and the first above; None if the grid's lowest LR
    is already past it or no LR reaches it (a crossing outside the grid is not extrapolated)."""
    logs = {}
    for lr, p in sorted(points.items()):
        values = [
            v
            for v in p["runs"]["attention_logit_max"]
            if v is not None and math.isfinite(v) and v > 0
        ]
        if values:
            logs[lr] = sum(math.log(v) for v in values) / len(values)
    target, lrs = math.log(ATTENTION_LOGIT_BLOWUP), sorted(logs)
    for below, above in zip(lrs, lrs[1:]):
        if logs[below] < target <= logs[above]:
            t = (target - logs[below]) / (logs[above] - logs[below])
            return math.exp(math.log(below) + t * (math.log(above) - math.log(below)))
    return None


def ladder_markdown(steps):
    def lr(v):
        return "not crossed in the grid" if v is None else f"{v:.2g}"

    def sens(v):
        return "no complete curve" if v is None else f"{v:.3f}"

    lines = [
        "### The size ladder: arm A against width",
        "",
        "Per width (depth 4, heads of 32), over the seeds run at every width ("
        + (", ".join(str(s) for s in next(iter(steps.values()))["seeds"]) if steps else "none")
        + "): the LR at which "
        "the default's largest attention logit (geometric mean over those seeds) passes 1e4, interpolated "
        "between grid LRs, and the LR sensitivity over "
        "1e-3..3e-1 (default / qk-layernorm, of the seeds' mean curve); from the third width on, each predicted "
        "from the two smallest widths (a line in log width) beside what was measured:",
        "",
        "| width | runs | logit 1e4 at LR: measured | predicted | sensitivity: measured | predicted |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for width, step in steps.items():
        guess = step.get("predicted")
        measured = (
            " / ".join(sens(v) for v in step["sensitivity"].values()) if step["n"] else "not run"
        )
        lines.append(
            f"| {width} | {step['n']} | {lr(step['crossing']) if step['n'] else 'not run'} | "
            + (
                f"{lr(guess['crossing'])} (from {guess['from'][0]}, {guess['from'][1]})"
                if guess
                else ""
            )
            + f" | {measured} | "
            + (" / ".join(sens(v) for v in guess["sensitivity"].values()) if guess else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# The tables


def total_or_none(values):
    return None if any(v is None for v in values) else sum(values)


def _mean(values):
    """The mean of the finite values (None, NaN and inf left out); NaN if there are none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def spread(values, digits=3):
    """Values of n seeds as a table shows them: each value for n < 3 (two points are no interval), the mean and
    the min-max over n >= 3; always with n."""
    values = list(values)
    if len(values) < 3:
        return ", ".join(f"{v:.{digits}f}" for v in values) + f" (n={len(values)})"
    mean = sum(values) / len(values)
    return (
        f"{mean:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}] (n={len(values)})"
    )


def sensitivity_cell(entry):
    """One range's LR sensitivity over the seeds whose curve is complete there: the seeds named for n < 3."""
    per_seed = entry["seeds"]
    if not per_seed:
        return "no seed ran every LR"
    if len(per_seed) < 3:
        return (
            ", ".join(f"{v:.3f}" for v in per_seed.values())
            + f" (seed{'s' if len(per_seed) > 1 else ''} {', '.join(map(str, per_seed))})"
        )
    return spread(per_seed.values())


def markdown(rows_by_arm, lrs_by_arm, corpus, warnings, code=None, width=WIDTH, references=None):
    """The report's tables, per arm. references: {arm: the rows of the arm it names as its reference} (arm F's:
    arm N's runs at the same width and code), for the table of the one against the other, run by run."""
    lines = []
    if warnings:
        lines += [
            "**WARNING: this study cannot show what it tests** (run with --allow_weak_study):",
            "",
            *[f"- {w}" for w in warnings],
            "",
        ]
    lines += [
        f"Corpus: {corpus['tokens']:,} tokens of a {VOCAB_SIZE}-token BPE; entropy per token: uniform "
        f"L0 = {L0:.3f}, unigram {corpus['unigram_entropy']:.3f}, bigram (given the previous token) "
        f"H2 = {corpus['bigram_entropy']:.3f} nats.",
        "",
    ]
    if code:
        runs = sum(
            p["n"]
            for arm, rows in rows_by_arm.items()
            for row in rows
            for p in row["points"].values()
            if not counted_elsewhere(arm, row["lever_set"], rows_by_arm)
        )
        lines += [
            f"Every run below ran on code {code} (the last commit of the code it trained with: "
            f"lr_sweep.code_version), at width {width}: {runs} run{'s' if runs != 1 else ''}.",
            "",
        ]
    for arm, rows in rows_by_arm.items():
        lrs = lrs_by_arm[arm]
        header = [
            "| lever set | " + " | ".join(f"{lr:.0e}" for lr in lrs) + " |",
            "| --- |" + " --- |" * len(lrs),
        ]
        ranges = {
            label: [lr for lr in lrs if low <= lr <= high]
            for label, (low, high) in SENSITIVITY_RANGES.items()
        }
        # once if equal
        ranges = {label: x for label, x in ranges.items() if label == "grid" or x != ranges["grid"]}
        titles = [
            f"LR sensitivity over {x[0]:.0e}..{x[-1]:.0e}"
            + (" (the grid)" if label == "grid" else " (Wortsman et al.'s range)")
            for label, x in ranges.items()
            if x
        ]
        lines += [
            f"### Arm {arm}: {ARMS[arm]['title']}",
            "",
            "LR sensitivity per seed, of the seeds run at every LR of the range (no run stands in for a "
            "missing one); mean [min-max] where n >= 3:",
            "",
            "| lever set | " + " | ".join(titles) + " | best final loss (seed mean) | at LR |",
            "| --- |" + " --- |" * (len(titles) + 2),
        ]
        for row in rows:
            cells = [sensitivity_cell(row["ranges"][label]) for label, x in ranges.items() if x]
            best = row["points"][row["best_lr"]]
            lines.append(
                f"| {row['lever_set']} | "
                + " | ".join(cells)
                + f" | {row['best_loss']:.3f} (n={best['n']}) | {row['best_lr']:.0e} |"
            )
        logit = (
            ", or an attention logit past 1e4"
            if ARMS[arm].get("logit_blows_up", True)
            else "; not the attention logits, which arm A tests and the others compare with it"
        )
        lines += [
            "",
            "Final validation loss: each seed's for n < 3, mean [min-max] for n >= 3, n the seeds run; "
            "`up k`: k of the n blew up (a NaN, or the loss back above H2 after having been clearly below it"
            f"{logit}); `logit k`: k passed an "
            "attention logit of 1e4; `flat k`: k never got below the bigram entropy; `div k`: k ended above L0 "
            "(counted as L0)"
            + (
                "; `stop k`: the spike guard stopped k (no final loss: counted as L0, and in `div`)"
                if any(p["stopped"] for row in rows for p in row["points"].values())
                else ""
            )
            + ":",
            "",
            *header,
        ]
        for row in rows:
            cells = []
            for lr in lrs:
                p = row["points"].get(lr)
                if p is None:
                    cells.append("not run")
                    continue
                cell = spread(p["values"])
                for key, label in (
                    ("blew_up", "up"),
                    ("logit_past_1e4", "logit"),
                    ("never_below", "flat"),
                    ("diverged", "div"),
                    ("stopped", "stop"),
                ):
                    cell += f" {label} {p[key]}" if p[key] else ""
                cells.append(cell)
            lines.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Precursors, mean over the n seeds of the cell above: "
            + "; ".join(PRECURSORS.values())
            + ":",
            "",
            *header,
        ]
        for row in rows:
            cells = [
                " / ".join(f"{row['points'][lr][key]:.3g}" for key in PRECURSORS)
                if lr in row["points"]
                else ""
                for lr in lrs
            ]
            lines.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")
        if ARMS[arm].get("remedies"):
            lines += [
                "",
                "Iterations that applied no update, summed over the cell's n seeds: skipped (the log's `number of "
                "skipped iterations`: an fp16 overflow, a non-finite grad norm, SkipStep's or the guard's veto) / "
                "with a NaN loss; `-` where a run's record predates the count:",
                "",
                *header,
            ]
            for row in rows:
                cells = [
                    " / ".join(
                        "-" if row["points"][lr][key] is None else str(row["points"][lr][key])
                        for key in NO_UPDATE
                    )
                    if lr in row["points"]
                    else ""
                    for lr in lrs
                ]
                lines.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")
            lines += remedy_table(rows)
            lines += twin_table(rows)
        if (references or {}).get(arm):
            lines += reference_table(rows, references[arm], lrs, arm, ARMS[arm]["reference"])
        lines.append("")
    return "\n".join(lines)


def remedy_table(rows, margin=STABLE_MARGIN):
    """Each remedy's final loss against the best run of the arm (any lever set, any LR) and its stable LR range."""
    best = min(row["best_loss"] for row in rows)
    lines = [
        "",
        f"Each remedy against the best run of the arm ({best:.3f}, seed mean): its best final loss and "
        f"the widest range of neighbouring grid LRs whose seed-mean final loss is within {margin} nats of it:",
        "",
        "| lever set | best final loss - the arm's best | stable LR range | grid points |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        found = stable_range(row, best, margin)
        span = f"{found[0]:.0e}..{found[1]:.0e}" if found else "none"
        lines.append(
            f"| {row['lever_set']} | {row['best_loss'] - best:+.3f} | {span} | "
            f"{found[2] if found else 0} of {len(row['points'])} |"
        )
    return lines


def seed_pairs(point, twin):
    """(seed, the twin's final loss, this one's) for each seed both cells ran; none where the twin is missing."""
    theirs = dict(zip(twin["seeds"], twin["values"])) if twin else {}
    return [(s, theirs[s], v) for s, v in zip(point["seeds"], point["values"]) if s in theirs]


def twin_table(rows, margin=WORSE_MARGIN):
    """Each lever set against none run by run: its twin is none's run at the same LR and seed, which differs only
    in the lever. How many of its runs ended on none's final loss (to the recorded digits: a remedy that never
    acted), worse, better; the largest gap each way; every run worse by more than `margin` by name. A cell's mean
    can hide a run a remedy made worse (issue 50: never worse than doing nothing, or say where)."""
    none = next((row for row in rows if row["lever_set"] == "none"), None)
    if none is None:
        return []
    lines = [
        "",
        "Each lever set against none, run by run (its twin: none's run at the same LR and seed): its runs with a "
        f"twin, how many ended on the twin's final loss, worse, better, and the largest gap each way; each run "
        f"worse by more than {margin} nats is listed below the table:",
        "",
        "| lever set | runs | equal | worse | better | most worse (LR, seed) | most better (LR, seed) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    listed = []
    for row in rows:
        if row is none:
            continue
        gaps = []  # (its loss - none's, LR, seed, none's, its)
        for lr, p in row["points"].items():
            gaps += [
                (value - twin, lr, seed, twin, value)
                for seed, twin, value in seed_pairs(p, none["points"].get(lr))
            ]
        worse = [g for g in gaps if g[0] > 0]
        better = [g for g in gaps if g[0] < 0]

        def most(found, pick):
            if not found:
                return "-"
            gap, lr, seed = pick(found)[:3]
            return f"{gap:+.3f} ({lr:.0e}, {seed})"

        lines.append(
            f"| {row['lever_set']} | {len(gaps)} | {len(gaps) - len(worse) - len(better)} | {len(worse)} | "
            f"{len(better)} | {most(worse, max)} | {most(better, min)} |"
        )
        listed += [
            (row["lever_set"], *g)
            for g in sorted(worse, key=lambda g: (g[1], g[2]))
            if g[0] > margin
        ]
    lines.append("")
    lines += [
        f"- {lever} at {lr:.0e}, seed {seed}: {its:.3f} against none's {theirs:.3f} ({gap:+.3f})"
        for lever, gap, lr, seed, theirs, its in listed
    ] or [f"No run ended worse than its twin by more than {margin} nats."]
    return lines


def reference_table(rows, reference, lrs, arm, other):
    """Each cell of `arm` against the same lever set, LR and seeds of the arm it names as its reference: the mean
    over the seeds both ran of its final loss minus the other's, n the seeds paired."""
    theirs = {row["lever_set"]: row["points"] for row in reference}
    lines = [
        "",
        f"Arm {arm} against arm {other}, run by run (the same lever set, LR and seed): the mean over the seeds both "
        f"ran of {arm}'s final loss minus {other}'s, n the seeds paired:",
        "",
        "| lever set | " + " | ".join(f"{lr:.0e}" for lr in lrs) + " |",
        "| --- |" + " --- |" * len(lrs),
    ]
    for row in rows:
        cells = []
        for lr in lrs:
            mine = row["points"].get(lr)
            pairs = seed_pairs(mine, theirs.get(row["lever_set"], {}).get(lr)) if mine else []
            gaps = [value - twin for _, twin, value in pairs]
            cells.append(f"{sum(gaps) / len(gaps):+.3f} (n={len(gaps)})" if gaps else "")
        lines.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")
    return lines


# -----------------------------------------------------------------------------
# The figure


def plot(rows_by_arm, results, corpus, path):
    """Wortsman et al.'s figures, drawing what was run: per arm, final loss against LR, a marker per run, a line
    through the seeds' mean, the seeds' min-max as an error bar only where n >= 3 (no band: a band between LRs
    would shade LRs with fewer seeds); beside it what the arm is about: each run's largest attention logit (A, W,
    N, F), seed 1's mean output logit and log Z over the iterations (B), each run's spike score (C)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(rows_by_arm)
    fig, axes = plt.subplots(len(arms), 2, figsize=(11, 3.6 * len(arms)), dpi=72, squeeze=False)
    for (ax, right), arm in zip(axes, arms):
        for row in rows_by_arm[arm]:
            xs = sorted(row["points"])
            p = [row["points"][lr] for lr in xs]
            counts = sorted({q["n"] for q in p})
            seeds = f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}-{counts[-1]}"
            (line,) = ax.plot(
                xs, [q["mean"] for q in p], linewidth=1, label=f"{row['lever_set']} ({seeds})"
            )
            color = line.get_color()
            ax.plot(
                [lr for lr, q in zip(xs, p) for _ in q["values"]],
                [v for q in p for v in q["values"]],
                "o",
                markersize=3.5,
                color=color,
                alpha=0.8,
            )
            wide = [(lr, q) for lr, q in zip(xs, p) if q["n"] >= 3]
            if wide:
                ax.errorbar(
                    [lr for lr, _ in wide],
                    [q["mean"] for _, q in wide],
                    yerr=[
                        [q["mean"] - q["min"] for _, q in wide],
                        [q["max"] - q["mean"] for _, q in wide],
                    ],
                    fmt="none",
                    ecolor=color,
                    capsize=3,
                    linewidth=1,
                )
            # N and F: the natural study's instabilities are the attention logits' slow climb
            logit_arms = ("A", "W", "N", "F")
            for key, axes_of in (("attention_logit_max", logit_arms), ("spike_score", ("C",))):
                if arm in axes_of:
                    scale = 100 if key == "spike_score" else 1
                    runs = [
                        (lr, v * scale)
                        for lr, q in zip(xs, p)
                        for v in q["runs"][key]
                        if v is not None and math.isfinite(v)
                    ]
                    right.plot(
                        [lr for lr, _ in runs],
                        [v for _, v in runs],
                        "o",
                        markersize=3.5,
                        color=color,
                        label=row["lever_set"],
                    )
        for key, style in (("bigram_entropy", "--"), ("unigram_entropy", ":")):
            ax.axhline(
                corpus[key], color="grey", linestyle=style, linewidth=1, label=key.replace("_", " ")
            )
        ax.set_ylim(top=L0 + 0.3)
        ax.set_title(
            f"arm {arm}: final validation loss (a dot a run; bars: min-max where n >= 3)",
            fontsize=10,
        )
        ax.set_ylabel("final loss (nats)")
        ax.legend(fontsize=7)
        if arm in ("A", "W", "N", "F"):
            right.axhline(
                ATTENTION_LOGIT_BLOWUP, color="grey", linestyle="--", linewidth=1, label="1e4"
            )
            right.set_yscale("log")
            right.set_title(
                f"arm {arm}: largest attention logit in training, a dot a run", fontsize=10
            )
        elif arm == "C":
            right.set_title(
                "arm C: spike score of the grad norm (%, 7 sigma), a dot a run", fontsize=10
            )
        elif arm == "B":
            runs = [
                r
                for r in results
                if r["arm"] == "B" and "error" not in r and r["seed"] == 1 and r.get("series")
            ]
            colors = {lr: f"C{i}" for i, lr in enumerate(sorted({r["lr"] for r in runs}))}
            for r in sorted(runs, key=lambda r: (r["lr"], r["lever_set"])):
                s = r["series"]
                style = {"no_z_loss": "--", "z_loss": "-"}.get(r["lever_set"], ":")
                right.plot(
                    s["iteration"],
                    s["output_logit_mean"],
                    style,
                    color=colors[r["lr"]],
                    linewidth=1,
                    label=f"{r['lever_set']}, LR {r['lr']:.0e}",
                )
                right.plot(
                    s["iteration"],
                    s["log_z"],
                    style,
                    color=colors[r["lr"]],
                    linewidth=2.5,
                    alpha=0.4,
                )
            if not runs:
                right.text(
                    0.5,
                    0.5,
                    "no series: no run of seed 1 with its metrics.jsonl",
                    ha="center",
                    transform=right.transAxes,
                )
            right.axhline(0, color="grey", linewidth=0.8)
            # the drift of a few nats, and a diverged run's hundreds
            right.set_yscale("symlog", linthresh=10)
            right.set_title(
                "arm B: mean output logit (thin) and mean log Z (thick), seed 1", fontsize=10
            )
            right.set_xlabel("iteration")
        for axis in (ax, right) if arm != "B" else (ax,):
            axis.set_xscale("log")
            axis.set_xlabel("learning rate")
        for axis in (ax, right):
            axis.grid(alpha=0.3)
        if any(not line.get_label().startswith("_") for line in right.lines):
            right.legend(fontsize=7)
    fig.tight_layout()
    with files.replaced(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)


# -----------------------------------------------------------------------------
# --report --results: the tables and the figure from the tracked records, into a page (--docs)


DOCS_BEGIN = "<!-- lr_sweep --report --docs writes what follows, up to its end marker; edit lab/sweep_report.py -->"


DOCS_END = "<!-- end of what lr_sweep --report --docs writes -->"


def docs_section(docs, text, arms, width):
    """Where --report --docs writes in the page `docs`, whose text is `text`: (begin marker, end marker, the
    figure's path). A page of several selections (lab/natural.md: arm N at widths 64 and 128, arm F at 64) names
    each in its markers, and each has its own figure; a page with the plain markers holds one (lab/stability.md)."""
    tag = f" --arms {','.join(arms)} --width {width}"
    begin, end = (marker.replace(" --docs", " --docs" + tag) for marker in (DOCS_BEGIN, DOCS_END))
    stem = os.path.splitext(docs)[0]
    if begin in text or end in text:
        return begin, end, f"{stem}_{'_'.join(arms)}_w{width}.png"
    return DOCS_BEGIN, DOCS_END, stem + ".png"


def report_from_records(args, arms):
    """--report --results FILE: the tables, the ladder and the figure from the tracked records alone."""
    records = with_same_runs(load_records(args.results))
    selected, code = one_code([r for r in records if in_selection(r, arms, args.width)], args.code)
    if not selected:
        raise SystemExit(
            f"lr_sweep: {args.results} has no run of the selection (width {args.width}); "
            "widen it (--arms, --lever_sets, --lrs, --seeds, --width, --code)"
        )
    corpora = {json.dumps(r["corpus"], sort_keys=True) for r in selected}
    if len(corpora) > 1:
        raise SystemExit(
            f"lr_sweep: {args.results}'s runs of the selection were measured on {len(corpora)} corpora; "
            "a table compares like with like"
        )
    corpus = selected[0]["corpus"]
    rows_by_arm = {
        arm: summarize(selected, arm, list(spec["levers"]), spec["lrs"], corpus["bigram_entropy"])
        for arm, spec in arms.items()
    }
    rows_by_arm = {arm: rows for arm, rows in rows_by_arm.items() if rows}
    # an arm's reference arm (arm F's: N) on the same code and width, for the table of the one against the other
    references = {}
    for arm in rows_by_arm:
        other = ARMS[arm].get("reference")
        if other:
            spec = {**ARMS[other], "levers": arms[arm]["levers"], "lrs": arms[arm]["lrs"]}
            theirs = [
                r
                for r in records
                if r["code"] == code and in_selection(r, {other: spec}, args.width)
            ]
            references[arm] = summarize(
                theirs, other, list(spec["levers"]), spec["lrs"], corpus["bigram_entropy"]
            )
    table = markdown(
        rows_by_arm,
        {arm: spec["lrs"] for arm, spec in arms.items()},
        corpus,
        [],
        code,
        args.width,
        references,
    )
    defined = sum(
        len(seeds_at(spec, lr))
        for arm, spec in arms.items()
        for lever in spec["levers"]
        for lr in spec["lrs"]
        if not counted_elsewhere(arm, lever, arms)
    )
    present = sum(not counted_elsewhere(r["arm"], r["lever_set"], arms) for r in selected)
    table = (
        f"{present} of the selection's {defined} runs are in {os.path.basename(args.results)} on this code "
        "(a cell `not run` was not run on it, and each cell's n counts the seeds that ran; a lever set that is "
        "another arm's runs counts there).\n\n" + table
    )
    ladder_runs = [r for r in records if r["arm"] == "A" and r["code"] == code]
    if "A" in arms and len({r["width"] for r in ladder_runs}) > 1:
        table += "\n" + ladder_markdown(ladder(ladder_runs, corpus["bigram_entropy"], LADDER))
    files.write_text(table, os.path.join(args.out, "results.md"))
    plot(rows_by_arm, selected, corpus, os.path.join(args.out, "lr_sweep.png"))
    if args.docs:
        with open(args.docs) as f:
            text = f.read()
        begin, end, figure = docs_section(args.docs, text, arms, args.width)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise SystemExit(
                f"lr_sweep: {args.docs} needs the two markers, once each and in this order, around the "
                f"place of the tables:\n{begin}\n{end}\n(or, for a page of several selections, the same "
                f"with this one named after --docs: --arms {','.join(arms)} --width {args.width})"
            )
        head, rest = text.split(begin)
        files.write_text(
            head + begin + "\n\n" + table.rstrip("\n") + "\n\n" + end + rest.split(end, 1)[1],
            args.docs,
        )
        plot(rows_by_arm, selected, corpus, figure)
    print(table)
    print(
        f"wrote {args.out}/results.md, lr_sweep.png"
        + (f"; {args.docs} and its figure" if args.docs else "")
    )
