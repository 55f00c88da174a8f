"""The stability lab: LR sensitivity of the stability levers, measured as Wortsman et al. 2023 do ("Small-scale
proxies for large-scale Transformer training instabilities"); lab/stability.md has the study and its numbers.

    python lab/lr_sweep.py --out out/lab --jobs 2  # the whole study: pilot, arms A, B, C, W (117 runs, ~10 CPU-h)
    python lab/lr_sweep.py --quick                 # the pilot alone: 2 runs, ~5 min
    python lab/lr_sweep.py --arms A --lever_sets default --lrs 1e-2,1e-1 --seeds 1,2 --out out/mine
    python lab/lr_sweep.py --out out/lab --report  # the tables and the figure of the runs finished so far
    python lab/lr_sweep.py --out out/lab --report --arms A --record lab/results.jsonl  # track the runs
    python lab/lr_sweep.py --report --results lab/results.jsonl --arms A,W --code dbe2d5a \
        --docs lab/stability.md                      # lab/stability.md's tables and figure, from the tracked file
    python lab/lr_sweep.py --arms A --width 64 --seeds 3 --out out/lab  # the size ladder's width 64

One GPT (4 layers of 128, 4 heads of 32) on the bundled corpus under the lab's own 512-token BPE
(lab/bpe_corpus.py: with GPT-2's 50k vocabulary a small model is 89-97% embedding), trained as Wortsman et al.
train theirs, scaled down: 1,000 steps of 16 x 128 tokens, 100 of linear warm-up then cosine decay to 1e-5,
AdamW (0.9, 0.95, eps 1e-8), clipping at 1, independent weight decay 1e-4 (the decay per step does not change
with the LR: optim.decay_coefficient), fp32, no dropout. Four arms, each pairing levers as the paper does:

  A  qk-layernorm (their figs. 1-2): default vs qk-layernorm, both with z-loss 1e-4, LRs 1e-3 .. 1 in half decades,
     3 seeds at every LR;
  B  z-loss (figs. 3-4): qk-layernorm on, no weight decay, z-loss 0 vs 1e-4 (and 1e-2) at LRs 1e-2, 1e-1, 1: log Z's
     drift;
  C  the chronicles' levers on arm A's default where it breaks (LRs 1e-2 .. 1e-1): the init std 0.63/sqrt(h)
     (the 104B's "small init", sqrt(2/5h)) against 2.15/sqrt(h) (0.02 at the 104B's h = 11,600), each with and
     without the embedding LayerNorm, 3 seeds; gradient-norm spikes counted (OLMo 2's spike score);
  W  warm-up length (the 104B's remedy; Wortsman et al.'s warm-up figure): arm A's default with 100 (its own runs,
     not run again) against 300 iterations of warm-up, arm A's grid and seeds.

The study is three files: lab/sweep_arms.py defines it (the model, the arms, each run's arguments, the preflight),
this one runs it, lab/sweep_report.py reads and reports what ran (the summaries, the tracked records, the tables,
the figure).

Before any run a preflight refuses a study that cannot show anything (an embedding-dominated model, a warm-up under
100 steps, weight decay coupled to the LR across an LR grid, qk-layernorm or z-loss tested without its partner);
then the pilot (arm A's default at LRs 1e-2 and 3e-1) must end below the corpus's bigram entropy at 1e-2 and pass
an attention logit of 1e3 at 3e-1, or the rest is refused. --allow_weak_study runs it anyway, with the
problems written at the top of results.md.

Each run is train.py in a process of its own (`lr_sweep.py --train ARGS`: train.py's main with denormals flushed,
one thread each, --jobs at a time) in OUT/runs/<arm>/<lever set>/lr<lr>-seed<seed>/: stdout.log, the metrics.jsonl
train.py writes (every iteration's loss and grad norm, the telemetry every 10), checkpoints every 100 iterations,
code.json (the code version it trains with: code_version), and result.json, written last. A run whose directory
holds result.json is finished and skipped (its numbers are read again from its metrics.jsonl, so that a change to
the summaries applies to it); a run killed half way resumes from its last checkpoint (train.py resumes bit for bit;
metrics.jsonl is read on the timeline the run ends on, report.read_metrics). From all finished runs of the selection
it writes OUT/results.jsonl, OUT/results.md (the tables) and OUT/lr_sweep.png (the figure). out/ is not tracked:
--record adds one short line a run to a tracked file (lab/results.jsonl), from which --report --results rebuilds the
tables and the figure alone. A table holds the runs of one code version: runs of two are refused together (--code
picks one), so that a run of older code never passes for a seed of today's.

LR sensitivity is theirs: the mean over the LR grid of min(L(lr), L0) - L*, with L* the curve's best final
loss over the grid and L0 = ln 512, the loss of the uniform prediction (every init but the 2.15/sqrt(h) one starts
there); reported over the arm's grid and over Wortsman et al.'s range (1e-3..3e-1 here), per seed and only for a
seed run at every LR of the range: no run stands in for a missing one. A cell of the tables shows its n; an
interval (the seeds' min-max) only where n >= 3, and the figure draws each run, with no band. A run *blew up* if
its training loss (mean of 10 iterations) rose above the corpus's bigram entropy after iteration BLOWUP_FROM (the
pilot's default at LR 1e-2 is below it from there on) having been clearly below it, or it produced a NaN: the loss
at init, which the old study used, is above where a small LM learns anything. A largest attention logit past 1e4
(Wortsman et al. 3.1) is counted apart (`logit`), and counts as a blow-up only in arm B, which does not test it.
"""

import argparse
import concurrent.futures
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bpe_corpus  # noqa: E402
import files  # noqa: E402 (bpe_corpus puts the repository on the path)
from sweep_arms import (  # noqa: E402
    ARMS,
    HEAD_DIM,
    PILOT,
    QUICK,
    ROOT,
    WIDTH,
    config_of,
    in_selection,
    preflight,
    run_dir,
    same_as,
    seeds_at,
    train_args,
)
from sweep_report import (  # noqa: E402
    PILOT_MARGIN,
    markdown,
    merge_records,
    one_code,
    plot,
    read_metrics,
    record,
    report_from_records,
    summarize,
    summarize_run,
)

# Which code a run trained with: the last commit that changed anything but the docs, the tests, the lab's records
# and figures, and the study's three files (sweep_arms.py's run-shaping part, BASE and ARMS, each run records as its
# arguments; sweep_report.py reads runs; this one runs them), "+dirty" when the work tree differs from it there. A
# commit to the report alone leaves it as it is, so that a study going on across such commits stays one code
# version; runs of two versions are never mixed in one table (sweep_report.one_code).
CODE_PATHS = [
    ".",
    ":(exclude)docs",
    ":(exclude)tests",
    ":(exclude)*.md",
    ":(exclude)lab/lr_sweep.py",
    ":(exclude)lab/sweep_arms.py",
    ":(exclude)lab/sweep_report.py",
    ":(exclude)lab/tests",
    ":(exclude)lab/results.jsonl",
    ":(exclude)lab/campaign",
    ":(exclude)lab/*.png",
]


def code_version(root=ROOT):
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("log", "-1", "--format=%h", "--", *CODE_PATHS)
        dirty = git("status", "--porcelain", "--", *CODE_PATHS)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def record_code(directory, code):
    """Write the run's code version into its directory (code.json) when it starts; a run resumed on other code
    is refused: its two halves would be of two versions."""
    path = os.path.join(directory, "code.json")
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f)["code"]
        if before != code:
            raise SystemExit(
                f"lr_sweep: {directory} was started on code {before} and would resume on {code}; "
                "delete the directory to run it again on this code, or check out " + before
            )
        return
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"code": code}, f)


def read_code(directory):
    path = os.path.join(directory, "code.json")
    if not os.path.exists(path):
        return "unrecorded"
    with open(path) as f:
        return json.load(f)["code"]


# -----------------------------------------------------------------------------
# One run


def run(command, log, env):
    """Run command with its output appended to the file log; returns (exit code, CPU seconds it used)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    # this child's own resource usage (other runs go on in parallel)
    _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


# the spike guard's stop as a run's log ends with it: the exception's last line from the run's own process, or
# train.py's "error:" line where train.py ran as a script
GUARD_STOP = re.compile(
    r"^(?:\S*SpikeGuardStop: |error: )spike guard: iteration (\d+): (.*)$", re.M
)


def guard_stop(directory):
    """{iteration, message} of the spike guard's first stop where the run's log holds one, else None. A stopped run
    is finished: its method ended it, and an attempt on the same code (a run is one code version: code.json) stops
    again. It scores as a diverged run does, L0 (the guard's campaigns score a run that did not finish at the same
    ln 512). The first: a runner that knows no stop (the study's, a146575's) tries the run again at each restart,
    resuming from the state the stop saved, and what it trains after the stop is not the run."""
    log = os.path.join(directory, "stdout.log")
    if not os.path.exists(log):
        return None
    first = GUARD_STOP.search(open(log, errors="replace").read())
    return {"iteration": int(first[1]), "message": first[2][:300]} if first else None


def stopped_result(directory, key, args, stop):
    """A run the spike guard stopped (`stop`: guard_stop's), as result.json holds it: no final loss (None: L0 in
    every table), the iteration (`stopped_at`, as its record keeps it) and the guard's message, the rest of the
    summaries from what it logged up to the stop."""
    metrics = read_metrics(os.path.join(directory, "metrics.jsonl"), upto=stop["iteration"])
    return {
        **key,
        "args": args,
        "code": read_code(directory),
        **summarize_run(metrics, config_of(args).adam_eps),
        "val_loss": None,
        "stopped_at": stop["iteration"],
        "stop_message": stop["message"],
    }


def execute(out, arm, lever_set, lr, seed, extra=(), width=WIDTH):
    """Train one run (unless finished; resumed if interrupted), write result.json last. Returns the result, with
    the code version the run recorded when it started (code.json)."""
    target = same_as(arm, lever_set)
    if target:  # another arm's runs: trained (or read) as that arm's, in its directory (run_dir), labelled as ours
        return {**execute(out, *target, lr, seed, extra, width), "arm": arm, "lever_set": lever_set}
    directory = run_dir(out, arm, lever_set, lr, seed, width)
    result_file = os.path.join(directory, "result.json")
    args = train_args(arm, lever_set, lr, seed, directory, extra, width)
    key = {"arm": arm, "lever_set": lever_set, "lr": lr, "seed": seed, "width": width}
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)

        def unplaced(a):  # a run directory moved elsewhere holds the same run
            return [x for x in a or [] if not x.startswith("--save=")]

        # the study was redefined: its results are not this run's
        if unplaced(result.get("args")) != unplaced(args):
            raise SystemExit(
                f"{directory} holds a run with other arguments than this study's; use another --out "
                "or delete it"
            )
        # finished by a runner that knows no stop, resumed past one: the run is the stopped one (guard_stop);
        # where the resume ended is kept beside it, not as its final loss
        stop = guard_stop(directory) if result.get("stopped_at") is None else None
        if stop:
            return {
                **stopped_result(directory, key, args, stop),
                "resumed_val_loss": result.get("val_loss"),
            }
        # the numbers are read again from metrics.jsonl: a changed summary applies to finished runs too
        return {
            **result,
            "width": width,
            "code": read_code(directory),
            **summarize_run(
                read_metrics(
                    os.path.join(directory, "metrics.jsonl"), upto=result.get("stopped_at")
                ),
                config_of(args).adam_eps,
            ),
            # a stopped run's last validation loss is an intermediate one: it has no final loss
            **({"val_loss": None} if result.get("stopped_at") is not None else {}),
        }
    # stopped by the guard in an earlier attempt: finished, not trained again (read, not written: the
    # attempt that stopped wrote result.json, or a runner of older code, which writes none, ran it)
    stop = guard_stop(directory)
    if stop:
        return stopped_result(directory, key, args, stop)
    os.makedirs(directory, exist_ok=True)
    # glibc would hand large freed blocks back to the kernel and page-fault them in afresh: keep them.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        WANDB_MODE="disabled",
        MALLOC_MMAP_THRESHOLD_=str(32 << 20),
        MALLOC_TRIM_THRESHOLD_=str(4 << 30),
    )
    start = time.time()
    with open(os.path.join(directory, "stdout.log"), "a") as log:  # a resumed run appends
        code, cpu = run([sys.executable, os.path.abspath(__file__), "--train", *args], log, env)
    seconds = time.time() - start
    stop = guard_stop(directory) if code != 0 else None
    if stop:
        return write_result(
            directory, {**stopped_result(directory, key, args, stop), "cpu_seconds": round(cpu, 1)}
        )
    if code != 0:
        with open(os.path.join(directory, "stdout.log")) as f:
            return {**key, "error": f.read()[-2000:]}
    cfg = config_of(args)
    metrics = read_metrics(os.path.join(directory, "metrics.jsonl"))
    # stopped early: resumed next time
    if metrics["iterations"] < cfg.train_iters or metrics["val_loss"] is None:
        return {
            **key,
            "error": f"{directory}: stopped at iteration {metrics['iterations']} of {cfg.train_iters}"
            + (
                ""
                if metrics["val_loss"] is not None
                else " without its final validation loss (if it is at the "
                "last iteration, it was killed after its last save: delete the directory)"
            ),
        }
    result = {
        **key,
        "args": args,
        "code": read_code(directory),
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        **summarize_run(metrics, cfg.adam_eps),
    }
    return write_result(directory, result)


def write_result(directory, result):
    """result.json, atomically (present means finished), once the checkpoints have served their purpose
    (resuming)."""
    for name in os.listdir(directory):
        if name.startswith("global_step") or name in ("latest", "lock"):
            path = os.path.join(directory, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    result_file = os.path.join(directory, "result.json")
    files.write_text(json.dumps(result), result_file)
    return result


# -----------------------------------------------------------------------------
# Main


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the pilot alone: " + json.dumps(QUICK))
    p.add_argument(
        "--out", default=os.path.join(ROOT, "out", "lab"), help="directory of runs and results"
    )
    p.add_argument("--arms", help="comma-separated, from: " + ", ".join(ARMS))
    p.add_argument("--lever_sets", help="comma-separated: only these lever sets of the arms")
    p.add_argument("--lrs", help="comma-separated learning rates (default: each arm's grid)")
    p.add_argument("--seeds", help="comma-separated seeds (default: each arm's)")
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count(), help="runs at a time, one thread each"
    )
    p.add_argument(
        "--extra",
        default="",
        help="more train.py arguments for every run, after an = sign (e.g. "
        "--extra=--train_iters=1000); changes the runs, so use another --out",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="only the tables and the figure, from the selection's "
        "runs finished so far (the pilot's included); starts no run",
    )
    p.add_argument(
        "--allow_weak_study",
        action="store_true",
        help="run a study that the preflight or the pilot refuses; results.md says why it is weak",
    )
    p.add_argument(
        "--width",
        type=int,
        default=WIDTH,
        help="the model's width (the size ladder: depth 4, heads of "
        f"{HEAD_DIM}; arms A, N, F); runs of another width than {WIDTH} go to OUT/runs/w<width>/",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        help="add the finished runs' summaries to FILE, one line a run "
        "(lab/results.jsonl is the study's tracked record)",
    )
    p.add_argument(
        "--results",
        metavar="FILE",
        help="with --report: the tables and the figure from FILE's lines "
        "(written by --record) instead of OUT's run directories",
    )
    p.add_argument(
        "--docs",
        metavar="MD",
        help="with --report: also write the tables into MD between its two "
        "`lr_sweep --report` markers and the figure to MD's name with .png (lab/stability.md); "
        "markers that name the selection (--arms N --width 64) mark one of a page's sections, "
        "with its own figure (lab/natural.md)",
    )
    p.add_argument(
        "--code", help="only the runs of this code version (a report refuses to mix versions)"
    )
    args = p.parse_args(argv)
    if (args.results or args.docs) and not args.report:
        p.error("--results and --docs go with --report")
    # the runs' --save, whatever directory they are started from
    args.out = os.path.abspath(args.out)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, getattr(args, key) or ",".join(map(str, value)))
    args.arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    args.lever_sets = args.lever_sets.split(",") if args.lever_sets else None
    args.lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else None
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
    return args


def selection(args):
    """{arm: spec} narrowed to the command line's lever sets, LRs and seeds."""
    arms = {}
    for arm in args.arms:
        spec = dict(ARMS[arm])
        if args.lever_sets:
            spec["levers"] = {k: v for k, v in spec["levers"].items() if k in args.lever_sets}
        spec["lrs"] = args.lrs or spec["lrs"]
        spec["seeds"] = args.seeds or spec["seeds"]
        spec["more_seeds"] = {} if args.seeds else spec.get("more_seeds", {})
        if spec["levers"]:
            arms[arm] = spec
    if not arms:
        raise SystemExit(f"no lever set of arms {args.arms} is called {args.lever_sets}")
    return arms


def train(argv):
    """One run: train.py's main with denormal floats flushed to zero. A run that blows up drives most of its
    softmax's probabilities below fp32's normal range, where x86 arithmetic on denormals is 2-4x slower; flushed,
    they read as the zeros they round to a moment later."""
    saves = [a.split("=", 1)[1] for a in argv if a.startswith("--save=")]
    if saves:
        record_code(saves[-1], code_version())
    import torch

    torch.set_flush_denormal(True)
    # train.py is a script, not a module to import: run its file and call the main it defines
    runpy.run_path(os.path.join(ROOT, "train.py"), run_name="stablegpt_train")["main"](argv)


def check_pilot(results, bigram):
    """The pilot's verdict: a list of sentences, empty when the setup can show the effects."""
    by_lr = {r["lr"]: r for r in results if "error" not in r}
    problems = []
    low, high = by_lr.get(PILOT[0][2]), by_lr.get(PILOT[1][2])
    if low is None or not low["val_loss"] < bigram - PILOT_MARGIN:
        loss = "failed" if low is None else f"{low['val_loss']:.3f}"
        problems.append(
            f"pilot: arm A's default at LR {PILOT[0][2]:g} ends at {loss}, not clearly below the bigram "
            f"entropy {bigram:.3f} (by {PILOT_MARGIN}): nothing that attention learned can be lost; train "
            "longer or deeper"
        )
    if high is None or not (high.get("attention_logit_max") or 0) > 1e3:
        logit = "failed" if high is None else f"{high.get('attention_logit_max')}"
        problems.append(
            f"pilot: arm A's default at LR {PILOT[1][2]:g} has a largest attention logit of {logit}, not "
            "above 1e3: the attention-logit growth under study does not happen in this setup"
        )
    return problems


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:  # internal: one run of the grid, in its own process
        return train(argv[1:])
    args = parse_args(argv)
    arms, extra = selection(args), args.extra.split()
    if args.results:
        return report_from_records(args, arms)
    warnings = preflight(arms, extra)
    if warnings and not args.allow_weak_study:
        raise SystemExit(
            "lr_sweep: this study cannot show what it tests:\n  - "
            + "\n  - ".join(warnings)
            + "\nfix the setup, or pass --allow_weak_study to run it anyway"
        )
    # the corpus and its tokenizer once, before the runs race to build them
    corpus = bpe_corpus.build()
    import data

    data.IndexedDataset(corpus["prefix"])
    grid = [
        (arm, lever, lr, seed)
        for arm, spec in arms.items()
        for lever in spec["levers"]
        for lr in spec["lrs"]
        for seed in seeds_at(spec, lr)
    ]
    width = args.width
    unpiloted = False
    narrow = [arm for arm, spec in arms.items() if width not in spec.get("widths", [width])]
    if narrow:
        raise SystemExit(
            f"lr_sweep: arm {narrow[0]} runs at width {ARMS[narrow[0]]['widths']} only; pass "
            f"--width {ARMS[narrow[0]]['widths'][0]} or leave the arm out"
        )
    # the pilot is the study's width's; another width's runs are the ladder's, without it
    pilot = PILOT
    if width != WIDTH:
        if not set(arms) <= {"A", "N", "F"}:
            raise SystemExit(
                "lr_sweep: --width is the size ladder of arms A, N and F; pass --arms A, N or F"
            )
        pilot = []

    # the pilot first, then every arm's first seed, then arm A's other seeds, then the others': an interrupted
    # study has whole curves, and arm A its seeds' spread first
    def order(g):
        again = seeds_at(arms[g[0]], g[2]).index(g[3])
        return (again > 0, again > 0 and g[0] != "A", again)

    grid = pilot + sorted((g for g in grid if g not in pilot), key=order)
    todo = [
        g
        for g in grid
        if not os.path.exists(os.path.join(run_dir(args.out, *g, width), "result.json"))
        and not guard_stop(run_dir(args.out, *g, width))
    ]
    print(
        f"{len(grid)} runs (the pilot's {len(pilot)} first), {len(grid) - len(todo)} finished already, "
        f"{len(todo)} to run, {args.jobs} at a time",
        flush=True,
    )
    if args.report:  # the finished runs alone; results.md says how many of the study's they are
        if len(todo) == len(grid):
            raise SystemExit(
                f"lr_sweep --report: no run of the selection has finished in {args.out}"
                + (" (the pilot has not run either)" if pilot else "")
                + "; run the study first"
            )
        unpiloted = any(g in todo for g in pilot)
        pilot = [g for g in pilot if g not in todo]
        grid = [g for g in grid if g not in todo]
    results, start = [], time.time()

    def report(result):
        results.append(result)
        status = (
            "error"
            if "error" in result
            else f"stopped by the spike guard at iteration {result['stopped_at']}"
            if result.get("stopped_at") is not None
            else f"val {result['val_loss']:.4f}"
        )
        print(
            f"[{time.time() - start:6.0f}s] {result['arm']} {result['lever_set']} lr {result['lr']:.0e} seed "
            f"{result['seed']}: {status}",
            flush=True,
        )

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda g: execute(args.out, *g, extra, width), pilot):
            report(result)
        # a report without the whole pilot has no verdict on the setup (its header says so)
        verdict = check_pilot(results, corpus["bigram_entropy"]) if pilot and not unpiloted else []
        if verdict and not args.allow_weak_study:
            raise SystemExit(
                "lr_sweep: the pilot says this study cannot show what it tests:\n  - "
                + "\n  - ".join(verdict)
                + "\nfix the setup, or pass --allow_weak_study to run it anyway"
            )
        warnings += verdict
        for result in pool.map(lambda g: execute(args.out, *g, extra, width), grid[len(pilot) :]):
            report(result)
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(
            f"failed: {r['arm']} {r['lever_set']} lr {r['lr']} seed {r['seed']}:\n{r['error']}",
            file=sys.stderr,
        )
    selected = [r for r in results if "error" not in r and in_selection(r, arms)]
    if args.record:
        merge_records(
            args.record,
            [record(r, corpus) for r in selected if not same_as(r["arm"], r["lever_set"])],
        )
    selected, code = one_code(selected, args.code)
    rows_by_arm = {
        arm: summarize(selected, arm, list(spec["levers"]), spec["lrs"], corpus["bigram_entropy"])
        for arm, spec in arms.items()
    }
    rows_by_arm = {arm: rows for arm, rows in rows_by_arm.items() if rows}
    files.write_text(
        "".join(json.dumps(r) + "\n" for r in results), os.path.join(args.out, "results.jsonl")
    )
    table = markdown(
        rows_by_arm, {arm: spec["lrs"] for arm, spec in arms.items()}, corpus, warnings, code, width
    )
    if args.report and unpiloted:
        table = (
            f"The pilot has not run in {args.out}: its verdict on the setup is not here.\n\n"
            + table
        )
    if args.report and todo:
        table = (
            f"{len(grid)} of the selection's {len(grid) + len(todo)} runs finished; the tables and the figure are "
            "theirs (a cell `not run` was not run, and each cell's n counts the seeds that ran).\n\n"
            + table
        )
    timed = [r for r in results if "cpu_seconds" in r]
    if timed:
        cpu = [r["cpu_seconds"] for r in timed]
        table += (
            f"\nCPU time, {len(timed)} runs: {sum(cpu) / len(cpu):.0f} s a run on average, "
            f"{sum(cpu) / 3600:.2f} h in all (a resumed run counts its last part only).\n"
        )
    files.write_text(table, os.path.join(args.out, "results.md"))
    plot(rows_by_arm, selected, corpus, os.path.join(args.out, "lr_sweep.png"))
    print(table)
    print(f"wrote {args.out}/results.jsonl, results.md, lr_sweep.png in {time.time() - start:.0f}s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
