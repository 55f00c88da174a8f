"""What-if forks: from a checkpoint before a spike, short continuations side by side, each with one change.

    python tools/whatif.py --load CKPT_DIR --iters 200 --out whatif/ -- config/tr8b_104b.py --key=value ...

Everything after `--` is the run's own command line (config file and overrides). Each fork is a process of its
own, `python train.py RUN_ARGS --load=CKPT_DIR --save=OUT/FORK --exit_interval=START+ITERS CHANGE` (START: the
checkpoint's iteration; exit_interval stops at its multiples, Megatron's, the first past START); a fork whose
directory already holds a checkpoint resumes from it, so a killed what-if picks up where it stopped (a rerun
with other arguments for it is refused: OUT/whatif.json records each fork's). Then one table (which forks got
through without a spike, found by the spike guard's own detector seeded with the checkpoint's statistics, and at
what loss) and one figure (loss and grad norm per fork, overlaid): OUT/whatif.png.

The changes leave the model function alone (PaLM's and the chronicles' remedies, docs/spike_guard.md):

    as is            nothing: does the spike come back at all?
    lr x F           the LR (and min_lr) x --lr_factor (0.5), override_lr_scheduler
    skip 200         the next 200 iterations' batches skipped (PaLM; --skip), then training goes on
    z-loss           z_loss=1e-4 (PaLM, lesson 20)
    optimizer reset  a fresh Adam with the lr=0 warm-up of lesson 8 (both moments)
    beta2 0.95       Adam's beta2 0.95 from now on, the moments kept (override_adam_params: a resume otherwise
                     refuses another beta2, as the optimizer state brings the checkpoint's)
    clip 0.3         tighter gradient clipping
    soft skip        metaseq's soft skip: a step whose loss is above --soft_skip_ratio (1.1) x its trend has its
                     gradients scaled by trend / loss before clipping (soft_skip_loss_ratio)
    guard            the spike guard's own ladder, with its diagnosis
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import arguments  # noqa: E402
import checkpoint  # noqa: E402
import files  # noqa: E402
import report  # noqa: E402
import safety  # noqa: E402
from sections import section  # noqa: E402
from stability import detector, spike_guard  # noqa: E402
from stability.detector import DetectorConfig  # noqa: E402

FORKS = (
    "as is",
    "lr x F",
    "skip 200",
    "z-loss",
    "optimizer reset",
    "beta2 0.95",
    "clip 0.3",
    "soft skip",
    "guard",
)


def change(fork, cfg, iteration, lr_factor, skip=200, soft_skip_ratio=1.1):
    """The command-line overrides of one fork, from the run's config at the checkpoint's iteration."""
    return {
        "as is": [],
        "lr x F": [
            f"--lr={cfg.lr * lr_factor!r}",
            f"--min_lr={cfg.min_lr * lr_factor!r}",
            "--override_lr_scheduler",
        ],
        "skip 200": [f"--skip_train_iteration_range={iteration + 1}-{iteration + skip}"],
        "z-loss": ["--z_loss=1e-4"],
        "optimizer reset": ["--reset_optimizer_warmup_iters=auto"],
        "beta2 0.95": ["--adam_beta2=0.95", "--override_adam_params"],
        "clip 0.3": ["--clip_grad=0.3"],
        "soft skip": [f"--soft_skip_loss_ratio={soft_skip_ratio!r}"],
        "guard": ["--spike_guard"],
    }[fork]


def saved_iteration(directory):
    tag = checkpoint.latest_dir(directory)
    return None if tag is None else int(os.path.basename(tag).replace("global_step", ""))


MARKER = "whatif.json"


def check_out(out, load, tag):
    """Refuse an --out whose forks would not be this --load's: a file, a folder of other files, or the forks
    of another checkpoint (they resume from their own directories, so their results would be reported as
    this checkpoint's). Returns OUT's marker: the one it holds, or a new one (no forks yet) for a new --out."""
    mine = {"load": os.path.realpath(load), "tag": tag}
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; give a directory (a new one, or this tool's own)")
    marker = os.path.join(out, MARKER)
    if not os.path.isdir(out) or not os.listdir(out):
        return {**mine, "forks": {}}
    if not os.path.isfile(marker):
        raise ValueError(
            f"--out {out} holds files this tool did not write (no {MARKER}); give a new --out"
        )
    try:
        with open(marker) as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--out {out}: {marker} cannot be read ({e}); give a new --out") from None
    if not isinstance(found, dict) or {key: found.get(key) for key in mine} != mine:
        was = f"{found.get('load')} at {found.get('tag')}" if isinstance(found, dict) else found
        raise ValueError(
            f"--out {out} holds the forks of {was}, not of {mine['load']} at {tag}; give a new --out "
            "(its forks would be reported as this checkpoint's)"
        )
    return {"forks": {}, **found}


def check_forks(out, marker, commands):
    """Refuse a fork whose directory in OUT holds a checkpoint of other arguments (a rerun with another
    --lr_factor, or other run arguments after `--`): it would be reused or resumed, and its results
    reported as these arguments'. commands: {fork: its train.py arguments, less the per-call ones}."""
    for name, command in commands.items():
        ran = marker["forks"].get(name)
        if ran != command and saved_iteration(fork_dir(out, name)) is not None:
            said = "were not recorded" if ran is None else f"differ: {_difference(ran, command)}"
            raise ValueError(
                f"--out {out} holds the fork '{name}' run with other arguments (they {said}); give "
                "a new --out (its results would be reported as these arguments')"
            )


def _difference(ran, command):
    """The arguments only the fork's run had, and those only these have."""
    gone = " ".join(a for a in ran if a not in command) or "nothing else"
    new = " ".join(a for a in command if a not in ran) or "nothing else"
    return f"it ran with {gone}, these have {new}"


def fork_dir(out, name):
    return os.path.join(out, name.replace(" ", "_"))


class ForkFailed(Exception):
    """A fork's train.py exited with an error: its last line, and where its whole output is."""


def run_fork(name, run_args, load, out, iters, extra):
    """Run (or finish) one fork; returns its directory."""
    directory = fork_dir(out, name)
    target = saved_iteration(load) + iters
    done = saved_iteration(directory) if os.path.isdir(directory) else None
    if done is not None and done >= target:
        return directory
    source = directory if done is not None else load
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *run_args,
        f"--load={source}",
        f"--save={directory}",
        f"--exit_interval={target}",  # the first multiple past the checkpoint's iteration
        "--log_interval=1",
        "--sample_tokens=0",
        *extra,
    ]
    print(f"whatif: {name}: {' '.join(cmd[2:])}", flush=True)
    # in the cwd, as the tool: a relative path after `--` (a config file, data_path) names the same file for both
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = os.path.join(out, name.replace(" ", "_") + ".log")
    with open(log, "a") as f:
        f.write(proc.stdout + proc.stderr)
    # a guard that gives up is a result, not a failure
    if proc.returncode not in (0, spike_guard.EXIT_CODE):
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        raise ForkFailed(
            f"fork {name!r} failed (exit {proc.returncode}): {said[-1] if said else 'no message'}"
            f"; its output: {log}"
        )
    return directory


def records(directory, after, last):
    """[(iteration, lm loss, grad norm)] of after+1..last of the timeline a fork's metrics.jsonl ends
    on (a fork an earlier call of more --iters ran holds more)."""
    found = report.read_metrics(os.path.join(directory, "metrics.jsonl"))
    return [
        (i, r["lm loss"], r["grad norm"])
        for i, r in found.items()
        if after < i <= last and "lm loss" in r
    ]


def table(results, start, iters):
    lines = [
        f"what-if from iteration {start}, {iters} iterations per fork:",
        f"{'fork':<18} {'spikes':>7} {'first':>6} {'max loss':>9} {'last loss':>10}  got through",
    ]
    for name, series, found, reached in results:
        losses = [loss for _, loss, _ in series]
        through = not found and reached
        lines.append(
            f"{name:<18} {len(found):>7} {found[0] if found else '-':>6} {max(losses):>9.4f} "
            f"{losses[-1]:>10.4f}  {'yes' if through else 'no'}"
        )
    return "\n".join(lines)


def figure(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, series, *_ in results:
        its = [it for it, _, _ in series]
        top.plot(its, [loss for _, loss, _ in series], label=name, linewidth=1.2)
        bottom.plot(its, [norm for _, _, norm in series], label=name, linewidth=1.2)
    top.set_ylabel("lm loss")
    bottom.set_ylabel("grad norm")
    bottom.set_yscale("log")
    bottom.set_xlabel("iteration")
    top.legend(fontsize=8)
    top.set_title("what-if forks")
    fig.tight_layout()
    with files.replaced(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def check_values(args):
    """Refuse a flag value no fork can run with, before the first fork (not at the fork that uses
    it, after the others' work)."""
    for flag, value, bound, what in (
        ("--iters", args.iters, 1, "iterations per fork"),
        ("--skip", args.skip, 1, "the iterations the 'skip 200' fork skips"),
        # the run's own rule for soft_skip_loss_ratio
        ("--soft_skip_ratio", args.soft_skip_ratio, 1, "a multiple of the loss's trend"),
    ):
        if not value >= bound:
            raise ValueError(f"{flag} {value} must be at least {bound}: {what}")
    if not args.lr_factor > 0:
        raise ValueError(f"--lr_factor {args.lr_factor} must be above 0: the LR's multiplier")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--load", required=True, help="checkpoint directory (its `latest`) to fork from"
    )
    parser.add_argument("--iters", type=int, required=True, help="iterations per fork")
    parser.add_argument(
        "--out", required=True, help="directory of the forks, the table and the figure"
    )
    parser.add_argument(
        "--forks", default=",".join(FORKS), help=f"comma-separated, of: {', '.join(FORKS)}"
    )
    parser.add_argument(
        "--lr_factor", type=float, default=0.5, help="the LR multiplier of the 'lr x F' fork"
    )
    parser.add_argument(
        "--skip", type=int, default=200, help="iterations (batches) the 'skip 200' fork skips"
    )
    parser.add_argument(
        "--soft_skip_ratio",
        type=float,
        default=1.1,
        help="the 'soft skip' fork scales the gradients of a loss above this x its trend",
    )
    args = parser.parse_args(argv)
    # the forks run train.py from the repository's root: their paths must not depend on the cwd
    args.load, args.out = os.path.abspath(args.load), os.path.abspath(args.out)
    forks = [f.strip() for f in args.forks.split(",")]
    unknown = [f for f in forks if f not in FORKS]
    if unknown:
        raise ValueError(f"unknown fork(s) {unknown}; choose from {', '.join(FORKS)}")
    check_values(args)
    # the run's arguments and --out before the checkpoint is read: a typo costs no wait
    cfg = arguments.load_config(run_args)
    start = saved_iteration(args.load)
    if start is None:
        raise ValueError(
            f"no checkpoint in {args.load} (no `latest`): point --load at a run's save directory"
        )
    marker = check_out(args.out, args.load, os.path.basename(checkpoint.latest_dir(args.load)))
    files.check_output_dir(args.out, "--out", "a directory for the forks, the table and the figure")
    extras = {
        name: change(name, cfg, start, args.lr_factor, args.skip, args.soft_skip_ratio)
        for name in forks
    }
    commands = {name: [*run_args, *extra] for name, extra in extras.items()}
    check_forks(args.out, marker, commands)
    # the run state alone, of any layout: the forks reshard the checkpoint, as any resume does
    run = safety.checkpoint_run(checkpoint.latest_dir(args.load))
    stats = detector.run_stats(run["state"])
    # before the forks run: a killed what-if's forks are resumed by a rerun of the same arguments only
    marker["forks"].update(commands)
    os.makedirs(args.out, exist_ok=True)
    files.write_text(json.dumps(marker), os.path.join(args.out, MARKER))
    results = []
    for name in forks:
        label = {"lr x F": f"lr x {args.lr_factor:g}", "skip 200": f"skip {args.skip}"}.get(
            name, name
        )
        directory = run_fork(name, run_args, args.load, args.out, args.iters, extras[name])
        series = records(directory, start, start + args.iters)
        reached = saved_iteration(directory) >= start + args.iters
        found = detector.spikes_in(series, section(DetectorConfig, cfg), cfg.clip_grad, stats)
        results.append((label, series, found, reached))
    text = table(results, start, args.iters)
    print(text)
    files.write_text(text, os.path.join(args.out, "whatif.txt"))
    figure(results, os.path.join(args.out, "whatif.png"))
    return results


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ForkFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
