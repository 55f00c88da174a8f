"""Plot runs the way the chronicles compare them: loss, grad norm, loss scale, LR, batch size, skips and spike-guard
actions, several runs overlaid; and the per-layer telemetry as heat maps (layer x iteration).

    python tools/plot.py checkpoints/tr8b-104B checkpoints/tr8b-104B-bnb --out runs.png
    python tools/plot.py slurm-1234.out --out old.png          # a log of Megatron lines (the chronicles' own logs)

A RUN is a directory holding metrics.jsonl (train.py writes it beside the checkpoints), a metrics.jsonl file, or
a log file of Megatron-DeepSpeed lines (` iteration N/ M | consumed samples: ... | lm loss: ... |`, validation
lines, `spike guard:` lines). When an iteration appears more than once (after a rollback or a resume), its last
record wins. The heat maps go to OUT with `_layers` before the extension, when a run has telemetry. Each figure
is written whole or not at all, over nothing but a figure of this tool's (a PNG it marked).
"""

import argparse
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import files  # noqa: E402
import report  # noqa: E402

ITERATION = re.compile(r"^\s*iteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+)")
GUARD = re.compile(r"^spike guard: iteration (\d+): (.*)$")
# the figures' PNG "Software" text: what tells this tool's figure (written over) from anyone's file (kept)
SOFTWARE = "stablegpt tools/plot.py"
LAYER_STATS = [
    "grad norm",
    "param norm",
    "update/param rms",
    "block output rms",
    "attention logit max",
]
ACTION_STYLE = {"skip": ("tab:orange", ":"), "rollback": ("tab:red", "--"), "stop": ("black", "-")}


class Run:
    def __init__(self, label):
        self.label = label
        self.records = {}  # iteration -> {key: value}, the last record of each iteration
        self.skipped = []  # iterations skipped by a skip range (no update)
        self.actions = []  # (iteration, action) of the spike guard

    def add(self, iteration, values, replace=False):
        """replace: a new record of the iteration (a rollback or resume ran it again) drops the old one."""
        if replace:
            self.records[iteration] = {}
        self.records.setdefault(iteration, {}).update(values)

    def series(self, key):
        points = sorted(
            (i, r[key])
            for i, r in self.records.items()
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
        )
        return [i for i, _ in points], [v for _, v in points]


def _action(text):
    if "update skipped" in text or "no update" in text:
        return "skip"
    if "roll back" in text:
        return "rollback"
    return "stop" if "would exceed" in text or "no snapshot" in text else None


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def load(path):
    """A Run from a directory with metrics.jsonl, a metrics.jsonl file, or a Megatron log file."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    label = (
        os.path.basename(os.path.dirname(os.path.abspath(path)))
        if path.endswith("metrics.jsonl")
        else os.path.basename(path)
    )
    run = Run(label)
    with open(path, errors="replace") as f:
        jsonl = f.readline().lstrip().startswith("{")
        if not jsonl:  # a Megatron log
            f.seek(0)
            for line in f:
                _parse_log_line(run, line.rstrip("\n"))
    # metrics.jsonl: the timeline the run ends on (a resume's or a rollback's abandoned iterations left out)
    if jsonl:
        for record in report.read_metrics(path).values():
            for decision in record.pop("spike guard", []):
                run.actions.append((decision["iteration"], decision["action"]))
            if record.pop("skipped", None):
                run.skipped.append(record["iteration"])
            run.add(record.pop("iteration"), record)
    # a logged interval with skipped or NaN steps: marked at its iteration
    for (
        i,
        r,
    ) in run.records.items():
        if r.get("number of skipped iterations", 0) or r.get("number of nan iterations", 0):
            run.skipped.append(i)
    return run


def _parse_log_line(run, line):
    m = ITERATION.match(line)
    if m:
        iteration, values = int(m.group(1)), {"train iters": int(m.group(2))}
        for part in m.group(3).split("|"):
            key, sep, text = part.partition(":")
            if not sep:
                continue
            if key.strip().startswith("skipped"):
                run.skipped.append(iteration)
                run.add(iteration, {}, replace=True)
                return
            value = _number(text.strip())
            if value is not None:
                values[key.strip()] = value
        run.add(iteration, values, replace=True)
        return
    m = VALIDATION.search(line)
    if m:
        run.add(int(m.group(1)), {"validation lm loss": float(m.group(2))})
        return
    m = GUARD.match(line.strip())
    if m and _action(m.group(2)):
        run.actions.append((int(m.group(1)), _action(m.group(2))))


# -----------------------------------------------------------------------------
# Figures


def plot_runs(runs, out):
    fig, axes = plt.subplots(3, 2, figsize=(14, 12), sharex=True)
    (loss, norm), (scale, lr), (batch, events) = axes
    for k, run in enumerate(runs):
        color = f"C{k}"
        loss.plot(*run.series("lm loss"), color=color, lw=1, label=f"{run.label} train")
        x, y = run.series("validation lm loss")
        if x:
            loss.plot(x, y, "o--", color=color, ms=4, lw=1, label=f"{run.label} validation")
        norm.plot(*run.series("grad norm"), color=color, lw=1, label=run.label)
        scale.plot(*run.series("loss scale"), color=color, lw=1, label=run.label)
        lr.plot(*run.series("learning rate"), color=color, lw=1, label=run.label)
        batch.plot(
            *run.series("global batch size"), color=color, lw=1, label=f"{run.label} batch size"
        )
        x, y = run.series("curriculum seqlen")
        if x:
            batch.plot(x, y, ":", color=color, lw=1, label=f"{run.label} curriculum seqlen")
        # events: one row per run; skipped / NaN iterations as ticks, guard actions as markers and lines
        events.plot(run.skipped, [k] * len(run.skipped), "|", color="grey", ms=12)
        for action, (c, style) in ACTION_STYLE.items():
            its = [i for i, a in run.actions if a == action]
            events.plot(its, [k] * len(its), "v", color=c, ms=8, label=action if k == 0 else None)
            for i in its:
                loss.axvline(i, color=c, ls=style, lw=0.8, alpha=0.6)
    loss.set_title("lm loss (lines: spike guard skip / rollback / stop)")
    norm.set_title("grad norm")
    scale.set_title("loss scale")
    for ax in (loss, norm, scale):
        # a log axis with nothing positive on it (a log without loss scales) is matplotlib's error at save
        if any(np.any(np.asarray(line.get_ydata(), dtype=float) > 0) for line in ax.get_lines()):
            ax.set_yscale("log")
    lr.set_title("learning rate")
    batch.set_title("global batch size / curriculum seqlen")
    events.set_title("skipped or NaN iterations (|) and spike-guard actions")
    events.set_yticks(range(len(runs)), [r.label for r in runs])
    events.set_ylim(-0.5, len(runs) - 0.5)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    fig.tight_layout()
    save(fig, out, dpi=80)


def plot_layers(runs, out):
    """Heat maps (layer x iteration) of the per-layer telemetry: one column per run, one row per statistic."""
    runs = [r for r in runs if any("telemetry" in rec for rec in r.records.values())]
    if not runs:
        return False
    fig, axes = plt.subplots(
        len(LAYER_STATS), len(runs), figsize=(7 * len(runs), 3 * len(LAYER_STATS)), squeeze=False
    )
    for col, run in enumerate(runs):
        its = sorted(i for i, r in run.records.items() if "telemetry" in r)
        for row, key in enumerate(LAYER_STATS):
            ax = axes[row][col]
            grid = np.array([run.records[i]["telemetry"][key] for i in its], dtype=float).T
            log = key != "attention logit max" and np.nanmin(grid) > 0
            image = ax.imshow(
                np.log10(grid) if log else grid,
                aspect="auto",
                origin="lower",
                interpolation="nearest",
                extent=(its[0], its[-1], -0.5, grid.shape[0] - 0.5),
                cmap="viridis",
            )
            fig.colorbar(image, ax=ax, label=("log10 " if log else "") + key)
            ax.set_title(f"{run.label}: {key}")
            num_layers = len(run.records[its[0]]["telemetry"]["block output rms"])
            labels = [str(i) for i in range(1, num_layers + 1)]
            if grid.shape[0] == num_layers + 2:
                labels = ["embedding", *labels, "final"]
            step = max(1, len(labels) // 12)
            ax.set_yticks(range(0, len(labels), step), labels[::step])
            ax.set_ylabel("layer")
            ax.set_xlabel("iteration")
    fig.tight_layout()
    save(fig, out, dpi=70)
    return True


def save(fig, out, dpi):
    """The figure as a PNG marked as this tool's (SOFTWARE), whole or not at all (files.replaced)."""
    with files.replaced(out) as tmp:
        fig.savefig(tmp, dpi=dpi, metadata={"Software": SOFTWARE})
    plt.close(fig)


def _a_figure_of_ours(path):
    """A PNG whose text chunks (written before the pixels) name this tool."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and SOFTWARE.encode() in head


def layers_file(out):
    stem, ext = os.path.splitext(out)
    return f"{stem}_layers{ext}"


def check_out(path):
    """Refuse, before the runs are read and drawn, an --out the figures could not be saved to (matplotlib's
    traceback after the plotting otherwise), or a file there, or at its _layers name, that is not a figure of
    this tool's: it writes over its own figures only."""
    ours = (
        _a_figure_of_ours,
        "a figure of this tool's",
        "this tool writes over its own figures only",
    )
    files.check_output_file(path, "--out", "runs.png", ours)
    if not path.lower().endswith(".png"):
        raise ValueError(
            f"--out {path} must name a .png file (the figures are PNGs), e.g. runs.png"
        )
    files.check_output_file(layers_file(path), "--out", "runs.png", ours)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="directory with metrics.jsonl, the file, or a log"
    )
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument(
        "--labels", nargs="*", help="a label per run (default: the directory or file name)"
    )
    args = parser.parse_args(argv)
    check_out(args.out)
    if args.labels is not None and len(args.labels) != len(args.runs):
        raise ValueError(
            f"--labels gives {len(args.labels)} label(s) for {len(args.runs)} run(s): give one "
            "per run, in their order, or none (the directory or file names)"
        )
    for path in args.runs:
        if not os.path.exists(path):
            raise ValueError(
                f"{path} does not exist: give a run directory, a metrics.jsonl or a log file"
            )
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            raise ValueError(
                f"{path} holds no metrics.jsonl: give a run's save directory (train.py writes "
                "metrics.jsonl there), a metrics.jsonl or a log file"
            )
    runs = []
    for path in args.runs:
        runs.append(load(path))
        if not runs[-1].records:
            raise ValueError(
                f"{path} has no iteration records (metrics.jsonl lines or Megatron log lines)"
            )
    for run, label in zip(runs, args.labels or []):
        run.label = label
    plot_runs(runs, args.out)
    print(f"wrote {args.out}")
    if plot_layers(runs, layers_file(args.out)):
        print(f"wrote {layers_file(args.out)}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
