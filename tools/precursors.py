"""Warning before the spike: how many iterations of warning each precursor in the telemetry gives before a
divergence, with thresholds set on clean runs (docs/spike_guard.md, section 7).

    python tools/precursors.py --diverged out/prec/runs/A/default/lr1e+00-seed* \\
        --calibrate out/lab/runs/A/*/lr1e-02-seed1 --clean out/prec/runs/A/*/lr1e-02-seed2 --out precursors.md

Every argument is a run directory holding the metrics.jsonl train.py writes (the loss and grad norm of every
iteration, the telemetry every telemetry_interval). The precursors are precursors.PRECURSORS, the ones the
guard's early rung can watch.

- **Onset** of a divergence: the first iteration the guard's detector calls a spike (detector.spikes_in, fed
  the run's losses and grad norms with the guard's default settings, as train.py would feed it with the guard
  on), or the first NaN/inf loss if that comes first. The guard would have acted there: a warning is worth
  something only before it.
- **Threshold** of a precursor, from the calibration runs (clean runs): `margin` (2) x the largest value any
  of their telemetry records shows (for a precursor whose warning side is low: the smallest / `margin`; for log Z,
  a logarithm, the largest + ln `margin`: Z doubled). A run's value on the warning side of it is a warning.
- **Lead time**: the onset minus the first telemetry iteration on the warning side (positive: that many
  iterations of warning; 0 or negative: none, it came with or after the spike; "never": no crossing in the run).
  Its resolution is the run's telemetry_interval.
- **False positives**: of the held-out clean runs (--clean, not used for the thresholds), those with a crossing,
  and how many telemetry records crossed in all.
"""

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import arguments  # noqa: E402
import files  # noqa: E402
import report  # noqa: E402
from sections import section  # noqa: E402
from stability import detector, precursors  # noqa: E402
from stability.detector import DetectorConfig  # noqa: E402

MARGIN = 2.0
LOGARITHMS = {"log_z"}  # precursors that are logarithms: their margin is added, as ln(margin)


def read_run(directory):
    """(steps, telemetry) of a run: [(iteration, loss, grad norm)] of every logged iteration, and
    [(iteration, telemetry record)], of the timeline the run ends on (report.read_metrics)."""
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{directory} holds no metrics.jsonl: give run directories train.py wrote")
    records = report.read_metrics(path)
    steps = [
        (i, r["lm loss"], r.get("grad norm", math.nan))
        for i, r in records.items()
        if "lm loss" in r
    ]
    return steps, [(i, r["telemetry"]) for i, r in records.items() if "telemetry" in r]


def onset(steps, cfg=None):
    """The first iteration the guard's detector calls a spike, or the first NaN/inf loss; None: neither."""
    cfg = cfg or arguments.Config()
    finite = []
    for step in steps:
        if not (math.isfinite(step[1]) and math.isfinite(step[2])):
            break
        finite.append(step)
    found = detector.spikes_in(finite, section(DetectorConfig, cfg), cfg.clip_grad)
    if found:
        return found[0]
    return steps[len(finite)][0] if len(finite) < len(steps) else None


def series(telemetry, name, eps):
    return [(i, precursors.value(name, record, eps)) for i, record in telemetry]


def threshold(name, runs, eps, margin=MARGIN):
    """margin x the largest value of the runs' telemetry (or the smallest / margin, for a low warning side); log Z
    is a logarithm, so its margin is Z's: + ln(margin)."""
    values = [v for telemetry in runs for _, v in series(telemetry, name, eps) if math.isfinite(v)]
    if not values:
        raise ValueError(
            f"the --calibrate runs' telemetry holds no finite value of {name}: a threshold needs clean "
            "runs whose telemetry records it"
        )
    if name in LOGARITHMS:
        return max(values) + math.log(margin)
    high = precursors.PRECURSORS[name][1] == "high"
    return max(values) * margin if high else min(values) / margin


def crossings(telemetry, name, limit, eps):
    """The telemetry iterations on the warning side of the threshold `limit`."""
    return [i for i, v in series(telemetry, name, eps) if precursors.past(name, v, limit)]


def lead(start, crossed):
    """The iterations of warning: onset - first crossing (None: no onset, or no crossing)."""
    return None if start is None or crossed is None else start - crossed


def measure(diverged, calibrate, clean, eps=1e-8, margin=MARGIN):
    """Everything the table shows. diverged, calibrate, clean: {label: run directory}. Returns
    {"onsets": {label: iteration}, "rows": [{precursor, side, threshold, first {label: first crossing},
    leads {label: lead}, fp_runs, fp_records}]}."""
    diverged, calibrate, clean = (
        {label: read_run(d) for label, d in runs.items()} for runs in (diverged, calibrate, clean)
    )
    bare = [label for label, (_, telemetry) in calibrate.items() if not telemetry]
    if len(bare) == len(calibrate):  # the thresholds come from their telemetry
        raise ValueError(
            f"the --calibrate runs ({', '.join(bare)}) hold no telemetry records in their "
            "metrics.jsonl: give clean runs trained with --telemetry_interval=N"
        )
    onsets = {label: onset(steps) for label, (steps, _) in diverged.items()}
    rows = []
    for name in precursors.PRECURSORS:
        limit = threshold(name, [telemetry for _, telemetry in calibrate.values()], eps, margin)
        first = {
            label: next(iter(crossings(telemetry, name, limit, eps)), None)
            for label, (_, telemetry) in diverged.items()
        }
        leads = {label: lead(onsets[label], first[label]) for label in diverged}
        false = [len(crossings(telemetry, name, limit, eps)) for _, telemetry in clean.values()]
        rows.append(
            {
                "precursor": name,
                "side": precursors.PRECURSORS[name][1],
                "threshold": limit,
                "first": first,
                "leads": leads,
                "fp_runs": sum(n > 0 for n in false),
                "fp_records": sum(false),
            }
        )
    return {"onsets": onsets, "rows": rows, "clean": len(clean), "calibrate": len(calibrate)}


def group(label):
    """'A/default/lr1e+00-seed2' -> ('A/default/lr1e+00', 'seed2'): the setup and the seed."""
    head, _, tail = label.rpartition("-seed")
    return (head, f"seed{tail}") if head else (label, "")


def cell(start, crossed):
    """'+12 (@27)': 12 iterations of warning, crossed at 27; '-5 (@55)': after the onset; 'never': no crossing;
    '@27, no spike': crossed in a run whose loss never spiked; '-': neither."""
    if start is None:
        return "-" if crossed is None else f"@{crossed}, no spike"
    return "never" if crossed is None else f"{start - crossed:+d} (@{crossed})"


def markdown(result):
    onsets, setups = result["onsets"], {}
    for label in onsets:
        setups.setdefault(group(label)[0], []).append(label)
    spiked = [label for label in onsets if onsets[label] is not None]
    lines = [
        HEADER
        + "; ".join(
            f"{setup} "
            + ", ".join(
                f"{group(x)[1]} {onsets[x] if onsets[x] is not None else '-'}" for x in labels
            )
            for setup, labels in setups.items()
        ),
        "",
        "Lead time in iterations, per seed: +n (@i): the precursor crossed its threshold at iteration i, n "
        "iterations before the onset; 0 or -n: with or after it (no warning); never: no crossing. Mean and min over "
        f"the {len(spiked)} runs with an onset, a late or missing warning counting as 0. False positives: of "
        f"{result['clean']} held-out clean runs, those with a crossing (telemetry records crossing in all).",
        "",
        "| precursor | threshold | " + " | ".join(setups) + " | mean | min | false positives |",
        "| --- | --- | " + " | ".join("---" for _ in setups) + " | --- | --- | --- |",
    ]
    for row in result["rows"]:
        counted = [max(row["leads"][x] or 0, 0) for x in spiked]
        side = ">" if row["side"] == "high" else "<"
        cells = [
            " / ".join(cell(onsets[x], row["first"][x]) for x in labels)
            for labels in setups.values()
        ]
        mean, least = (
            (f"{sum(counted) / len(counted):.1f}", str(min(counted))) if counted else ("-", "-")
        )
        lines.append(
            f"| {row['precursor']} | {side} {row['threshold']:.3g} | "
            + " | ".join(cells)
            + f" | {mean} | {least} | {row['fp_runs']} ({row['fp_records']}) |"
        )
    return "\n".join(lines) + "\n"


HEADER = "Onset (the first iteration the guard's detector calls a spike; -: none), per run: "


def _a_table_of_ours(path):
    """Its first line starts with HEADER."""
    try:
        with open(path) as f:
            return f.readline().startswith(HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def check_out(path):
    """Refuse, before the measurement, an --out the table could not be written to, or a file that is not a
    table of this tool's: this tool writes over its own tables only."""
    files.check_output_file(
        path,
        "--out",
        "precursors.md",
        (_a_table_of_ours, "a table of this tool's", "this tool writes over its own tables only"),
    )


def labelled(directories, flag):
    """{label: directory}: the label is the path's last three parts (arm/lever set/lr-seed in the lab).
    Two runs of one label are refused: the table would show one of them as both."""
    found = {}
    for d in directories:
        label = "/".join(os.path.normpath(d).split(os.sep)[-3:])
        if label in found:
            raise ValueError(
                f"{flag}: {found[label]} and {d} have the same label {label} (a run's label is its "
                "path's last three parts): give each run once, or runs whose last three parts differ"
            )
        found[label] = d
    return found


def check_args(args):
    """Refuse, before any run is read, a margin or adam_eps no threshold can be made of, and a clean
    run held out from the thresholds that also makes them."""
    if not args.margin >= 1:  # below 1 the calibration runs' own values cross their threshold
        raise ValueError(
            f"--margin {args.margin} must be at least 1: the threshold is margin x the calibration "
            "runs' largest value (or their smallest / margin)"
        )
    if not args.adam_eps > 0:
        raise ValueError(f"--adam_eps {args.adam_eps} must be above 0: the runs' adam_eps")
    both = {os.path.realpath(d) for d in args.calibrate} & {os.path.realpath(d) for d in args.clean}
    if both:
        raise ValueError(
            f"{', '.join(sorted(both))} given to --calibrate and --clean: a held-out clean run "
            "must not make the thresholds it is checked against; give it to one of them"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diverged", nargs="+", required=True, help="run directories of divergences"
    )
    parser.add_argument(
        "--calibrate", nargs="+", required=True, help="clean runs the thresholds come from"
    )
    parser.add_argument(
        "--clean", nargs="*", default=[], help="held-out clean runs: the false positives"
    )
    parser.add_argument("--margin", type=float, default=MARGIN)
    parser.add_argument(
        "--adam_eps", type=float, default=1e-8, help="the runs' adam_eps (grad_rms_over_eps)"
    )
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args(argv)
    check_args(args)
    if args.out:
        check_out(args.out)
    result = measure(
        labelled(args.diverged, "--diverged"),
        labelled(args.calibrate, "--calibrate"),
        labelled(args.clean, "--clean"),
        args.adam_eps,
        args.margin,
    )
    text = markdown(result)
    print(text)
    if args.out:
        files.write_text(text, args.out)
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
