"""Warning before the spike: how many iterations of warning each precursor in the telemetry gives before a
divergence, with thresholds set on clean runs (docs/spike_guard.md, section 7; issue 20 part 4).

    python tools/precursors.py --diverged out/prec/runs/A/default/lr1e+00-seed* \\
        --calibrate out/lab/runs/A/*/lr1e-02-seed1 --clean out/prec/runs/A/*/lr1e-02-seed2 --out precursors.md

Every argument is a run directory holding the metrics.jsonl train.py writes (the loss and grad norm of every
iteration, the telemetry every telemetry_interval). The precursors are spike_guard.PRECURSORS, the ones the
guard's early rung can watch.

- **Onset** of a divergence: the first iteration the guard's detector calls a spike (spike_guard.spikes_in, fed
  the run's losses and grad norms with the guard's default settings, as train.py would feed it with the guard
  on), or the first NaN/inf loss if that comes first. The guard would have acted there: a warning is worth
  something only before it.
- **Threshold** of a precursor, from the calibration runs (clean runs): `margin` x the largest value any of
  their telemetry records shows (for a precursor whose warning side is low: the smallest / `margin`). A run's
  value on the warning side of it is a warning.
- **Lead time**: the onset minus the first telemetry iteration on the warning side (positive: that many
  iterations of warning; 0 or negative: none, it came with or after the spike; "never": no crossing in the run).
  Its resolution is the run's telemetry_interval.
- **False positives**: of the held-out clean runs (--clean, not used for the thresholds), those with a crossing,
  and how many telemetry records crossed in all.
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import arguments  # noqa: E402
import spike_guard  # noqa: E402

MARGIN = 2.0


def read_run(directory):
    """(steps, telemetry) of a run: [(iteration, loss, grad norm)] of every logged iteration, and
    [(iteration, telemetry record)]; the last record of an iteration wins (a resumed run repeats some)."""
    records = {}
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                records.setdefault(record["iteration"], {}).update(record)
    steps = [(i, r["lm loss"], r.get("grad norm", math.nan)) for i, r in sorted(records.items()) if "lm loss" in r]
    return steps, [(i, r["telemetry"]) for i, r in sorted(records.items()) if "telemetry" in r]


def onset(steps, cfg=None):
    """The first iteration the guard's detector calls a spike, or the first NaN/inf loss; None: neither."""
    cfg = cfg or arguments.Config()
    finite = []
    for step in steps:
        if not (math.isfinite(step[1]) and math.isfinite(step[2])):
            break
        finite.append(step)
    found = spike_guard.spikes_in(finite, cfg)
    if found:
        return found[0]
    return steps[len(finite)][0] if len(finite) < len(steps) else None


def series(telemetry, name, eps):
    return [(i, spike_guard.precursor_value(name, record, eps)) for i, record in telemetry]


def threshold(name, runs, eps, margin=MARGIN):
    """margin x the largest value of the runs' telemetry (or the smallest / margin, for a low warning side)."""
    values = [v for telemetry in runs for _, v in series(telemetry, name, eps) if math.isfinite(v)]
    high = spike_guard.PRECURSORS[name][1] == "high"
    return max(values) * margin if high else min(values) / margin


def crossings(telemetry, name, limit, eps):
    """The telemetry iterations on the warning side of the threshold `limit`."""
    return [i for i, v in series(telemetry, name, eps) if spike_guard.past(name, v, limit)]


def lead_time(steps, telemetry, name, limit, eps, cfg=None):
    """(onset, lead): the onset and the iterations of warning before it (None: no crossing in the run; a run
    with no onset has no lead time either: (None, None))."""
    start = onset(steps, cfg)
    if start is None:
        return None, None
    crossed = crossings(telemetry, name, limit, eps)
    return start, (start - crossed[0] if crossed else None)


def measure(diverged, calibrate, clean, eps=1e-8, margin=MARGIN):
    """Everything the table shows. diverged, calibrate, clean: {label: run directory}. Returns
    {"onsets": {label: iteration}, "rows": [{precursor, threshold, leads {label: lead}, fp_runs, fp_records}]}."""
    diverged, calibrate, clean = ({label: read_run(d) for label, d in runs.items()}
                                  for runs in (diverged, calibrate, clean))
    onsets = {label: onset(steps) for label, (steps, _) in diverged.items()}
    rows = []
    for name in spike_guard.PRECURSORS:
        limit = threshold(name, [telemetry for _, telemetry in calibrate.values()], eps, margin)
        leads = {label: lead_time(*run, name, limit, eps)[1] for label, run in diverged.items()}
        false = [len(crossings(telemetry, name, limit, eps)) for _, telemetry in clean.values()]
        rows.append({"precursor": name, "side": spike_guard.PRECURSORS[name][1], "threshold": limit,
                     "leads": leads, "fp_runs": sum(n > 0 for n in false), "fp_records": sum(false)})
    return {"onsets": onsets, "rows": rows, "clean": len(clean), "calibrate": len(calibrate)}


def group(label):
    """'A/default/lr1e+00-seed2' -> ('A/default/lr1e+00', 'seed2'): the setup and the seed."""
    head, _, tail = label.rpartition("-seed")
    return (head, f"seed{tail}") if head else (label, "")


def _lead(value):
    return "never" if value is None else f"{value:+d}"


def markdown(result):
    setups = {}
    for label in result["onsets"]:
        setups.setdefault(group(label)[0], []).append(label)
    lines = ["Onset (the first iteration the guard's detector calls a spike), per run: " + "; ".join(
        f"{setup} " + ", ".join(f"{group(x)[1]} {result['onsets'][x]}" for x in labels)
        for setup, labels in setups.items()), "",
        "Lead time in iterations (+n: the precursor crossed its threshold n iterations before the onset; 0 or -n: "
        f"with or after it; never: no crossing), per seed; mean and min over all {len(result['onsets'])} "
        f"diverged runs (never counts as 0); false positives: of {result['clean']} held-out clean runs, those "
        "with a crossing (telemetry records crossing in all).", "",
        "| precursor | threshold | " + " | ".join(setups) + " | mean | min | false positives |",
        "| --- | --- | " + " | ".join("---" for _ in setups) + " | --- | --- | --- |"]
    for row in result["rows"]:
        leads = row["leads"]
        counted = [max(v, 0) if v is not None else 0 for v in leads.values()]
        side = ">" if row["side"] == "high" else "<"
        cells = [" / ".join(_lead(leads[x]) for x in labels) for labels in setups.values()]
        lines.append(f"| {row['precursor']} | {side} {row['threshold']:.3g} | " + " | ".join(cells) +
                     f" | {sum(counted) / len(counted):.1f} | {min(counted)} | {row['fp_runs']} "
                     f"({row['fp_records']}) |")
    return "\n".join(lines) + "\n"


def labelled(directories):
    """{label: directory}: the label is the path's last three parts (arm/lever set/lr-seed in the lab)."""
    return {"/".join(os.path.normpath(d).split(os.sep)[-3:]): d for d in directories}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diverged", nargs="+", required=True, help="run directories of divergences")
    parser.add_argument("--calibrate", nargs="+", required=True, help="clean runs the thresholds come from")
    parser.add_argument("--clean", nargs="*", default=[], help="held-out clean runs: the false positives")
    parser.add_argument("--margin", type=float, default=MARGIN)
    parser.add_argument("--adam_eps", type=float, default=1e-8, help="the runs' adam_eps (grad_rms_over_eps)")
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args(argv)
    result = measure(labelled(args.diverged), labelled(args.calibrate), labelled(args.clean), args.adam_eps,
                     args.margin)
    text = markdown(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    main()
