"""A randomized campaign against the spike guard: faults nobody chose, drawn at random, and the numbers of what the
guard did with them (docs/spike_guard.md, "The campaign").

    python lab/guard_campaign.py --out runs/campaign --data_path DATA --minutes 45
    python lab/guard_campaign.py --out runs/campaign --report      # the table and figure from what has run

Each trial draws a fault family (FAMILIES), its start, length and magnitude, and a seed, and runs three runs of
the tests' 2x64 model with the project's guard flags (GUARD, as tests/test_spike_guard.py): the fault with the
guard, the fault without it, and the clean twin (same seed, precision and launch, guarded: any decision it takes is
a false positive). A fault on one DP replica runs each of the three on 2 gloo processes (torchrun); a fault after a
resume runs each as two processes in turn, the first saving at the resume point and stopping, the second resuming
with the fault (the clean twin resumes too). A fault is harmful when it raises the clean twin's final validation
loss by more than 1% unguarded, the unguarded run dies, or its DP replicas end with different weights. The report
gives the detection rate of harmful faults, the diagnosis confusion matrix (true cause x decided cause), false
positives per 1,000 clean iterations, rollbacks per fault and the final validation losses, each rate with its 95%
Wilson interval.

--method runs the same trials under another method (METHODS): "guard" (the three runs above), "none" (the clean twin
and the unguarded run only), or one of the field's remedies (stability/remedies.py and the core's
skip_grad_norm_above), which runs each harmful trial's fault under it and --clean_runs clean twins under it (their
actions are its false positives); the report then adds one table of methods x (detection, false positives per run
and per 1,000 iterations, right diagnosis where the method diagnoses, final-loss damage against the clean twin).
--preregister FILE freezes, before any run, the whole tree (a hash of HEAD's tree, lab/campaign/
aside, and a dirty flag), the draws, the metrics, the goals, the thresholds, the seed, the trials,
the model and every method's flags: a run from another tree or a dirty one, or under another
registration, is refused, every record carries the registration's id, and the report refuses to
mix registrations. Every record keeps its run's per-iteration losses and grad norms and its
method's actions, and is stamped with its UTC start and end, the commit, the tree, torch's
version and the machine (its CPU and vector instructions: machine()), which the registration
freezes too: the same run on two kinds of CPU can end apart.

The seventh campaign (docs/spike_guard.md, "The seventh campaign's design"): --draw seventh (the
default; stratified, its faults staying where they live: stability/faults.py), harm (the ninth's:
each family's candidates screened by their twins until HARMFUL_EACH are harmful), sixth or
withdrawn-61; --windows published or scaled (--window_scale), one rule for every method;
--snapshots off (the guard rolls back to disk checkpoints); OPT's bound calibrated on the clean
twins (--grad_norm_bound unset); --model 10M for the subset at scale. The report adds the primary
metric, the share of the damage removed, and the costs (lab/guard_metrics.py).

Resumable: each finished run is a line of OUT/runs.jsonl, and a restarted campaign runs only what is missing
(trial k's draw depends on --seed and k alone); a second campaign in the same OUT is refused while one runs
(OUT/lock). --jobs processes at a time (a 2-process run holds two); --minutes
bounds the wall time (no trial starts after it). Not a test: it measures, and docs quote what it measured.

This file is the command, the runs and the registration; the fault space and the draws are
lab/campaign_draw.py's, reading the records and scoring them lab/campaign_report.py's.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time

import torch

import guard_metrics
from campaign_draw import (
    DRAWS,
    FAMILIES,
    HARM,
    HARM_FIRST,
    HARMFUL_EACH,
    LONGER,
    SEVENTH,
    corpus_fault,
    corpus_samples,
    draw,
    draw_harm,
    draw_seventh,
    draw_withdrawn_61,
    fault_of,
    harmful_before,
    is_harmful,
    long_clean_seed,
    longer_fault,
    seventh_fault,
    stratum,
)
from campaign_report import (
    METHODS,
    measured,
    names,
    registration_id,
    report,
    runs_of,
    source_sha256,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import files  # noqa: E402
import safety  # noqa: E402

MODEL = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=64",
    "--vocab_size=512",
    "--micro_batch_size=8",
    "--global_batch_size=8",
    "--lr=2e-3",
    "--lr_warmup_samples=40",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--log_interval=1",
    "--eval_interval=100000",
    "--eval_iters=8",
    "--sample_tokens=0",
    "--save=none",
    "--save_interval=none",
]
# the default config's wider model (config/tiny.py: 4 layers x 128), at the campaign's sequence and batch
WIDE = ["--num_layers=4", "--hidden_size=128"]
# the subset's model of 10M+ parameters (6 x 384: 12 x 6 x 384^2 = 10.6M in its blocks), for --iters
# 1000 and more
BIG = ["--num_layers=6", "--hidden_size=384", "--num_attention_heads=6"]
MODELS = {"2x64": [], "4x128": WIDE, "10M": BIG}
GUARD = [
    "--spike_guard",
    "--spike_guard_window=20",
    "--spike_guard_min_steps=10",
    "--spike_guard_rewind=3",
    "--spike_guard_snapshot_interval=5",
]  # the sixth and earlier also had --spike_guard_skip_after=2 (their records hold their flags): gone since
# --snapshots off and the restarts go back to disk checkpoints saved this often (tr8-104B saved
# "every 300 iterations so that if we have to recover a training we don't have to roll back far"),
# scaled with the windows
SAVE_INTERVAL = 300
# method -> its flags, each remedy at its published default (stability/remedies.py cites each); grad_norm_skip is
# metaseq's --skip-gradient-update-on-clip-norm: the bound is the clip norm (--grad_norm_bound, clip_grad's 1.0)
REMEDIES = {
    "skip_step": ["--skip_step_sigma=6", "--skip_step_window=128"],
    "spiky_loss": ["--spiky_loss_factor=10", "--spiky_loss_samples=100"],
    "grad_norm_skip": [],
    "zclip": ["--zclip_z=2.5", "--zclip_alpha=0.97", "--zclip_warmup=25"],
    # the automated checkpoint restarts (remedies.OptRestart, PalmRestart), not in the sixth: from the
    # run's disk checkpoints, saved every SAVE_INTERVAL iterations as the guard's --snapshots off
    "opt_restart": ["--opt_restart_lr_factor=0.25", f"--save_interval={SAVE_INTERVAL}"],
    "palm_restart": ["--palm_restart_skip=200", f"--save_interval={SAVE_INTERVAL}"],
}
# The seventh campaign's rule for every method alike (--windows): each setting that counts
# iterations at its published default ("published": the guard's are its config defaults,
# its parts' sections), or every one of them x --window_scale ("scaled"); "sixth" keeps the sixth's
# flags (GUARD, REMEDIES), less the guard's spike_guard_skip_after, gone since (a data rollback
# skips no batch ahead).
WINDOWS = {
    "guard": {
        "spike_guard_window": 128,
        "spike_guard_min_steps": 16,
        "spike_guard_rewind": 100,
        "spike_guard_snapshot_interval": 50,
    },
    "skip_step": {"skip_step_window": 128},
    "spiky_loss": {"spiky_loss_samples": 100},
    "zclip": {"zclip_warmup": 25},
    # a restart's spike: SkipStep's rule on the loss (restart_window); PaLM's back and skip count
    # iterations too, and so does the disk cadence they go back to (the guard's --snapshots off's)
    "opt_restart": {"restart_window": 128, "save_interval": SAVE_INTERVAL},
    "palm_restart": {
        "restart_window": 128,
        "palm_restart_back": 100,
        "palm_restart_skip": 200,
        "save_interval": SAVE_INTERVAL,
    },
}
# each remedy's settings that are no window, at their published defaults
SETTINGS = {
    "skip_step": ["--skip_step_sigma=6"],
    "spiky_loss": ["--spiky_loss_factor=10"],
    "grad_norm_skip": [],
    "zclip": ["--zclip_z=2.5", "--zclip_alpha=0.97"],
    "opt_restart": ["--opt_restart_lr_factor=0.25", "--restart_sigma=6"],
    "palm_restart": ["--restart_sigma=6"],
}
LOG = re.compile(
    r"^ iteration +(\d+)/ *\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|.*?"
    r"number of skipped iterations: +(\d+)",
    re.M,
)


def base_args(trial, model, iters):
    """A trial's train.py flags but the fault's and the method's: the model, its batch (2 processes: the global
    batch two micro-batches, one per DP replica), precision and seed."""
    batch = 8 * trial["nproc"]
    return [
        *MODEL,
        *MODELS[model],
        f"--global_batch_size={batch}",
        f"--train_iters={iters}",
        f"--lr_decay_samples={batch * iters}",
        *trial["precision"],
        f"--seed={trial['seed']}",
    ]


def processes(base, fault, method, trial, checkpoint):
    """The argument lists of one run's processes: one; or, for a resumed trial, the first to iteration K (it saves
    in `checkpoint` and stops) and the resume, which alone has the fault's flags. Every run of a resumed trial
    resumes, the clean twin too: the fault is the only difference. A method that goes back to disk checkpoints
    saves at its own cadence in the first process too, as the run a resume comes from did: its checkpoints before
    K are there, and so is what the guard read at each (its update size's trend, without snapshots)."""
    # on 2 processes the last one saves at the end with every rank's weights (dump_weights): replica_gap() reads them
    dumps = [f"--save={checkpoint}", "--dump_weights"] if trial["nproc"] > 1 else []
    # a guard without snapshots (--snapshots off) and the restarts go back to the disk checkpoints
    # their flags save, in `checkpoint`
    disk = [f"--save={checkpoint}"] if goes_to_disk(method) else []
    if trial["resume"] is None:
        return [[*base, *fault, *method, *disk, *dumps]]
    k = trial["resume"]
    own = [f for f in method if f.startswith("--save_interval=")]
    saves = own or ["--save_interval=none"]
    # --exit_interval saves at K anyway
    first = own if disk else [f"--save_interval={k}"]
    return [
        [*base, *method, f"--save={checkpoint}", *first, f"--exit_interval={k}"],
        [*base, *method, *fault, f"--save={checkpoint}", *saves, *dumps],
    ]


def goes_to_disk(method):
    """Does the method (its flags) go back to disk checkpoints it saves itself?"""
    restarts = ("--opt_restart_lr_factor=", "--palm_restart_skip=")
    return "--spike_guard_snapshot_interval=0" in method or any(
        f.startswith(restarts) for f in method
    )


# a device's fault flags: what a requeue without the device drops (a data fault stays in the corpus, an LR or a
# numerical one in the run's settings)
DEVICE_FLAGS = ("--inject_bad_device_iter=", "--inject_bitflip_")


def run_one(out, name, parts, data_path, method="guard", nproc=1, requeue=False):
    """One run: train.py with each of `parts` in turn (processes() : a resumed run is two), under torchrun with
    nproc processes on gloo where nproc > 1; its record (exit code, final validation loss, the method's actions,
    rollbacks, and every logged iteration of every part as [iteration, loss, grad norm, skipped]: a rollback's
    replays appear again). A part that fails ends the run; the resumed run's checkpoint is removed after it.
    requeue: a guard stop whose record (SAVE/stopped.json) names a device (cause hardware or persistent) is
    followed as its message says: the node taken out (the last part's device fault flags dropped), the run
    resumed from what the stop saved; the record's "requeued" names the stop."""
    log = os.path.join(out, "logs", f"{name}.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
    )
    checkpoint = os.path.join(out, "checkpoints", name)
    # a run interrupted before: its resume starts over
    shutil.rmtree(checkpoint, ignore_errors=True)
    requeued = None
    with open(log, "w") as f:

        def train(args):
            command = [*launcher, "train.py", *args, f"--data_path={data_path}"]
            return subprocess.call(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)

        for args in parts:
            code = train(args)
            if code != 0:
                break
        stop = os.path.join(checkpoint, "stopped.json")
        if requeue and code != 0 and os.path.exists(stop):
            record = json.load(open(stop))
            if record.get("cause") in ("hardware", "persistent"):
                requeued = {k: record.get(k) for k in ("iteration", "cause", "dp_rank")}
                code = train([x for x in parts[-1] if not x.startswith(DEVICE_FLAGS)])
    gap = replica_gap(checkpoint) if nproc > 1 and code == 0 else None
    shutil.rmtree(checkpoint, ignore_errors=True)
    text = open(log).read()
    values = re.findall(r"lm loss value: (\S+)", text)
    lines = [x for x in text.splitlines() if x.startswith("spike guard:")]
    series = [
        [int(i), float(loss), float(norm), int(skips)] for i, loss, norm, skips in LOG.findall(text)
    ]
    held = re.search(r"spike guard snapshots(?: and async_save's copy)?: (\d+) x", text)
    return {
        "name": name,
        "exit": code,
        "valid": float(values[-1]) if values else math.nan,
        "method": method,
        "decisions": actions_of(text, method, series),
        "rollbacks": sum("rolled back to" in x for x in lines),
        "series": series,
        "nproc": nproc,
        "processes": len(parts),
        "replica_gap": gap,
        "snapshots": int(held[1]) if held else 0,
        **({"requeued": requeued} if requeued else {}),
    }


def replica_gap(checkpoint):
    """The largest |difference| between DP rank 0's and DP rank 1's final weights (the dumps of the run's last save):
    a replica that silently drifted (a low bit flipped on one rank, issue 41) ends the run above 0."""
    paths = sorted(
        glob.glob(os.path.join(checkpoint, "weight_dumps", "debug-*-before-save.pt")),
        key=lambda p: int(re.search(r"debug-(\d+)-", p)[1]),
    )
    last = re.search(r"debug-(\d+)-", paths[-1])[1]
    dp0, dp1 = (
        torch.load(next(p for p in paths if f"debug-{last}-" in p and f"-dp{d}-" in p))
        for d in (0, 1)
    )
    return max(float((dp0[n].float() - dp1[n].float()).abs().max()) for n in dp0)


def actions_of(text, method, series):
    """What the method did, one line per action, each naming its iteration: the guard's decisions, a remedy's
    lines, or the grad-norm skips (a skipped step whose grad norm is finite: a NaN/inf one the core skips anyway)."""
    lines = text.splitlines()
    if method == "guard":
        # the DP replica check acts alone where a majority names the healthy replica, or where no snapshot of
        # equal replicas is there to roll back to (snapshots off); otherwise the guard's own line says the rollback
        return [
            x
            for x in lines
            if (x.startswith("spike guard:") and is_decision(x))
            or (x.startswith("DP replica check:") and ("re-synced from" in x or "copy taken" in x))
        ]
    if method == "grad_norm_skip":
        return [
            f"grad_norm_skip: iteration {i}: skipped, grad norm {g:g}"
            for i, _, g, skips in series
            if skips and math.isfinite(g)
        ]
    return [x for x in lines if x.startswith(f"remedy {method}:")]


def is_decision(line):
    """A `spike guard:` line that is a decision (not a sample named, a fault injected, a host, a restore)."""
    noise = (
        ": sample ",
        "injected a ",
        " is global rank ",
        ": on rank ",
        "rolled back to",
        "the documents",
    )
    return re.match(r"spike guard: iteration \d+: ", line) is not None and not any(
        n in line for n in noise
    )


def model_of(a, k):
    """Trial k's model: --model, or with "mixed" the wider one for every fourth trial (k % 4 == 3)."""
    if a.model == "mixed":
        return "4x128" if k % 4 == 3 else "2x64"
    return a.model


def windows(method, a):
    """{key: value} of the method's settings that count iterations under --windows (published or
    scaled)."""
    scale = a.window_scale if a.windows == "scaled" else 1.0
    return {key: max(1, round(value * scale)) for key, value in WINDOWS.get(method, {}).items()}


def method_flags(method, a):
    """The method's flags under --windows and --snapshots; grad_norm_skip's bound is
    --grad_norm_bound (None: calibrated on the clean runs, calibrated_bound(): CALIBRATED stands for
    it until then)."""
    bound = CALIBRATED if a.grad_norm_bound is None else a.grad_norm_bound
    if method == "grad_norm_skip":
        return [f"--skip_grad_norm_above={bound}"]
    if a.windows == "sixth":
        return GUARD if method == "guard" else REMEDIES.get(method, [])
    flags = [f"--{key}={value}" for key, value in windows(method, a).items()]
    if method != "guard":
        return [*SETTINGS.get(method, []), *flags]
    if a.snapshots == "off":
        scale = a.window_scale if a.windows == "scaled" else 1.0
        flags = [f for f in flags if not f.startswith("--spike_guard_snapshot_interval=")]
        flags += [
            "--spike_guard_snapshot_interval=0",
            f"--save_interval={max(1, round(SAVE_INTERVAL * scale))}",
        ]
    return ["--spike_guard", *flags]


# grad_norm_skip's bound until calibrated_bound() has the clean runs to set it
CALIBRATED = "calibrated"


def campaign(a, registration=None):
    """Runs what --method needs of trials --first.. (and the long clean runs), each once: the clean twin and the
    unguarded run of every trial; then the guard's faulted run, or a remedy's faulted run of each harmful trial
    and its clean runs of the first --clean_runs trials. One campaign at a time in --out (OUT/lock): a second
    would run the same missing trials again and write over their logs."""
    held = safety.acquire_lock(a.out, "--out", "campaign")
    try:
        run_missing(a, registration)
    finally:
        safety.release_lock(held)


def run_missing(a, registration):
    """campaign's runs, --out locked."""
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    path = os.path.join(a.out, "runs.jsonl")
    done = runs_of(a.out) if os.path.exists(path) else {}
    reg_id, stamp = registration_id(registration), code_stamp()
    began, lock, slots, threads = time.time(), threading.Lock(), threading.Semaphore(a.jobs), []
    failed = []  # runs whose record could not be written: the campaign stops at the next submit or join

    def one(name, parts, meta, method, held):
        try:
            t0, started = time.time(), utc()
            record = {
                **run_one(
                    a.out,
                    name,
                    parts,
                    a.data_path,
                    method,
                    meta["nproc"],
                    a.requeue and method == "guard",
                ),
                **meta,
                "registration": reg_id,
                "seconds": round(time.time() - t0, 1),
                "started": started,
                "ended": utc(),
                **stamp,
            }
            with lock:
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            print(
                f"campaign: {name} ({meta['what']}): exit {record['exit']}, valid {record['valid']:.4f}, "
                f"{len(record['decisions'])} actions, {record['seconds']} s",
                flush=True,
            )
        except Exception as e:  # in a thread: kept, and raised where the campaign next waits
            failed.append(f"{name}: {e!r}")
        finally:
            for _ in range(held):
                slots.release()

    def settled():
        """Waits for every run submitted; stops the campaign if one left no record (a screen must
        not count a missing run as a harmless one)."""
        for t in threads:
            t.join()
        if failed:
            raise SystemExit(
                f"campaign: run {failed[0]} failed before its record was written: fix the cause and run "
                "again (the finished runs are kept)"
            )

    def submit(name, trial, base, fault, method):
        if name not in done:
            # --jobs processes at a time: a 2-process run holds two slots
            held = min(trial["nproc"], a.jobs)
            for _ in range(held):
                slots.acquire()
            if failed:  # a run that held a slot just failed: nothing more starts
                for _ in range(held):
                    slots.release()
                settled()
            checkpoint = os.path.join(a.out, "checkpoints", name)
            # a requeue resumes from what the guard's stop saved
            saves = [f"--save={checkpoint}"] if a.requeue and method == "guard" else []
            parts = processes(base, fault, [*method_flags(method, a), *saves], trial, checkpoint)
            meta = {
                key: trial[key]
                for key in ("trial", "family", "what", "start", "model", "nproc", "resume", "iters")
                if trial[key] is not None
            }  # a long clean run is no trial
            threads.append(threading.Thread(target=one, args=(name, parts, meta, method, held)))
            threads[-1].start()

    # false positives late in training, fewer start-ups
    for j in range(a.long_clean if a.method == "guard" else 0):
        n = a.long_iters
        long = {
            "trial": None,
            "family": None,
            "what": f"clean, {n} iterations",
            "start": None,
            "model": "2x64",
            "iters": n,
            "nproc": 1,
            "resume": None,
            "precision": [],
            "seed": long_clean_seed(a.seed, j),
        }
        submit(f"long{j}-clean", long, base_args(long, "2x64", n), [], "guard")
    trials = {}
    for k in range(a.first, a.first + a.trials):
        if time.time() - began > 60 * a.minutes:
            print(f"campaign: {a.minutes} minutes spent; stopped before trial {k}", flush=True)
            break
        trial = {
            "trial": k,
            **DRAWS[a.draw](a.seed, k, a.iters),
            "model": model_of(a, k),
            "iters": a.iters,
        }
        # the screen: a round of the draw (stratum's, whatever --first) runs once the rounds before are in
        if a.draw == "harm":
            if k % len(HARM_FIRST) == 0 or k == a.first:
                settled()
                done = runs_of(a.out) if os.path.exists(path) else {}
            if harmful_before(done, trial["family"], k, a.first, a.harm) >= HARMFUL_EACH:
                continue
        trials[k] = trial, base_args(trial, trial["model"], a.iters)
        submit(f"{k}-clean", trial, trials[k][1], [], "guard")
        submit(f"{k}-unguarded", trial, trials[k][1], trial["flags"], "none")
        if a.method == "guard":
            submit(f"{k}-guarded", trial, trials[k][1], trial["flags"], "guard")
    settled()
    # the references are in: a remedy runs the harmful faults and its clean runs
    if a.method in REMEDIES:
        done, threads[:] = runs_of(a.out), []
        if a.method == "grad_norm_skip" and a.grad_norm_bound is None:  # OPT's, on the clean twins
            cleans = [r for n, r in done.items() if n.endswith("-clean")]
            a.grad_norm_bound = guard_metrics.calibrated_bound(cleans)
            print(
                f"campaign: grad_norm_skip's bound, calibrated on the clean twins: "
                f"{a.grad_norm_bound:.4g}"
            )
        for k, (trial, base) in trials.items():
            faulted, clean = names(k, a.method)
            if is_harmful(done[f"{k}-clean"], done[f"{k}-unguarded"], a.harm):
                submit(faulted, trial, base, trial["flags"], a.method)
            if k < a.first + a.clean_runs:
                submit(clean, trial, base, [], a.method)
        settled()


# -----------------------------------------------------------------------------
# The registration: what is frozen before any run (of the scoring: campaign_report.measured)


def stability_sha256():
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "stability", "*.py"))):
        digest.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read())
    return digest.hexdigest()


def registration_of(a):
    """What a registration freezes: the whole tree (tree_state: its hash and a dirty flag; the
    commit; torch's version), the fault space (the families and the draw's code), the metrics (their
    code), the goals, the thresholds, the seed, the trials, the iterations, the model, the methods'
    rule and every method's flags."""
    return {
        **code_stamp(),
        "stability_sha256": stability_sha256(),
        "draw": a.draw,
        "families": {"seventh": SEVENTH, "harm": HARM_FIRST}.get(a.draw, FAMILIES),
        **(
            {"longer": {f: list(r) for f, r in LONGER.items()}, "harmful_each": HARMFUL_EACH}
            if a.draw == "harm"
            else {}
        ),
        "draw_sha256": source_sha256(DRAWN),
        **measured(a.harm),
        "seed": a.seed,
        "first": a.first,
        "trials": a.trials,
        "iters": a.iters,
        "model": a.model,
        "clean_runs": a.clean_runs,
        "windows": a.windows,
        "window_scale": a.window_scale,
        "snapshots": a.snapshots,
        **({"requeue": True} if a.requeue else {}),
        "methods": {m: method_flags(m, a) for m in METHODS},
    }


# the code a registration hashes beside the families: the draws, the runs' flags and launch, and
# what harm is
DRAWN = (
    draw,
    draw_withdrawn_61,
    fault_of,
    stratum,
    draw_seventh,
    seventh_fault,
    corpus_samples,
    corpus_fault,
    draw_harm,
    longer_fault,
    harmful_before,
    base_args,
    processes,
    is_harmful,
    windows,
    method_flags,
)


def code_stamp():
    """What every record and the registration carry of the code and the arithmetic it ran on: the
    commit, the whole tree's state (tree_state), torch's version and the machine (machine())."""
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "commit": git.stdout.strip(),
        **tree_state(),
        "torch": torch.__version__,
        "machine": machine(),
    }


def machine(cpuinfo="/proc/cpuinfo"):
    """The CPU a run's arithmetic comes from, beyond torch's version: its vendor, family, model and
    name, the vector instructions torch's and oneDNN's kernels choose by, and torch's own choice.
    The same run of the 10M model on two kinds of CPU, one torch, differed from its first
    iterations and ended up to 1.5% apart (docs/spike_guard.md, "Two machines' arithmetic")."""
    info = {}
    if os.path.exists(cpuinfo):
        for line in open(cpuinfo):
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    cpu = (
        f"{info.get('vendor_id', '?')} family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')} ({info.get('model name', '?')})"
    )
    isa = sorted(
        f for f in info.get("flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))
    )
    return {
        "cpu": cpu if info else platform.processor() or platform.machine(),
        "isa": " ".join(isa),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def tree_state():
    """{tree: a hash of HEAD's whole tree, lab/campaign/ aside (the registrations and records:
    committing one must not change it), dirty: uncommitted changes or untracked files outside
    lab/campaign/ and .gitignore}."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--full-tree", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    kept = "\n".join(x for x in listing if not x.split("\t", 1)[1].startswith("lab/campaign/"))
    return {"tree": hashlib.sha256(kept.encode()).hexdigest(), "dirty": bool(uncommitted())}


def utc():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def preregister(a):
    """The registration the runs go under (--preregister FILE), or None: a new FILE is written now, and only before
    any run in --out and with stability/ committed; an existing one must match this campaign and this code (its
    commit aside: committing the registration moves HEAD)."""
    if not a.preregister:
        return None
    now = registration_of(a)
    if not os.path.exists(a.preregister):
        if os.path.exists(os.path.join(a.out, "runs.jsonl")):
            raise SystemExit(
                f"--preregister {a.preregister}: {a.out} has runs already; a registration comes before "
                "any run: register in a new --out"
            )
        if now["dirty"]:
            first = uncommitted().splitlines()[0]
            raise SystemExit(
                f"--preregister: the tree has uncommitted changes ({first} ...): "
                "commit the tree first, so that the registration's hash names it"
            )
        now["written"] = utc()
        files.write_text(json.dumps(now, indent=1, sort_keys=True), a.preregister)
        print(f"campaign: registered {registration_id(now)} in {a.preregister}", flush=True)
        return now
    saved = json.load(open(a.preregister))
    if (saved.get("tree"), saved.get("dirty")) != (now["tree"], now["dirty"]):
        raise SystemExit(
            f"--preregister {a.preregister}: the tree (hash {now['tree'][:12]}, "
            f"{'dirty' if now['dirty'] else 'clean'}) is not the registered one "
            f"({str(saved.get('tree'))[:12]}, clean): run from the registered commit "
            f"{saved.get('commit')}, with nothing uncommitted, or register anew in a "
            "new --out"
        )
    if saved.get("machine") != now.get("machine"):
        here, there = now.get("machine") or {}, saved.get("machine") or {}
        raise SystemExit(
            f"--preregister {a.preregister}: this machine ({here.get('cpu')}, "
            f"{here.get('capability')}) is not the registered kind ({there.get('cpu', 'none recorded')}): "
            "on another CPU a run is not its twins' to the digit; run on a machine of the registered "
            "kind, or register anew in a new --out"
        )
    differ = [key for key in now if key != "commit" and saved.get(key) != now[key]]
    if differ:
        raise SystemExit(
            f"--preregister {a.preregister}: this campaign differs from its registration in "
            f"{', '.join(differ)}: run the registered code and flags, or register anew in a new --out"
        )
    return saved


def uncommitted():
    """git's short status of the whole tree but lab/campaign/ (empty: everything the runs use is
    committed)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--", ".", ":(exclude)lab/campaign"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--data_path", help="a tokenized corpus with ids < 512 (the tests' corpus512)")
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--iters", type=int, default=100, help="iterations per run")
    p.add_argument("--seed", type=int, default=28)
    p.add_argument(
        "--minutes", type=float, default=45.0, help="wall-time budget: no trial starts after it"
    )
    p.add_argument(
        "--first",
        type=int,
        default=0,
        help="the first trial's number (a second campaign beside one)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each one process)")
    p.add_argument(
        "--long_clean",
        type=int,
        default=0,
        help="clean guarded runs of --long_iters iterations, first",
    )
    p.add_argument("--long_iters", type=int, default=3000)
    p.add_argument(
        "--method", choices=METHODS, default="guard", help="the method the trials run under"
    )
    p.add_argument(
        "--model",
        choices=[*MODELS, "mixed"],
        default="2x64",
        help="the trials' model (mixed: every fourth trial the wider 4x128; 10M: the "
        "subset's, 10.8M parameters, for --iters 1000 or more)",
    )
    p.add_argument(
        "--clean_runs",
        type=int,
        default=20,
        help="a remedy's clean runs: the first N trials' twins",
    )
    p.add_argument(
        "--grad_norm_bound",
        type=float,
        default=None,
        help="grad_norm_skip's bound (default: calibrated, the clean twins' 99.9th "
        "percentile after iteration 50, guard_metrics.CALIBRATION)",
    )
    p.add_argument(
        "--draw",
        choices=list(DRAWS),
        default="seventh",
        help="the trials' draw: seventh (faults that stay where they live), harm (the ninth's: the "
        "seventh's, harm first: each family screened until HARMFUL_EACH are harmful; --trials caps "
        "the candidates), sixth (events in time), or withdrawn-61 (the withdrawn seed-61 "
        "registration's trials, with --seed 61)",
    )
    p.add_argument(
        "--windows",
        choices=["published", "scaled", "sixth"],
        default="published",
        help="every method's iteration-counting settings at their published "
        "defaults, or all x --window_scale, or the sixth campaign's flags",
    )
    p.add_argument(
        "--window_scale", type=float, default=None, help="--windows scaled: the one factor"
    )
    p.add_argument(
        "--snapshots",
        choices=["on", "off"],
        default="on",
        help="off: the guard rolls back to disk checkpoints saved every SAVE_INTERVAL iterations",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="the guard's runs save where they stop, and a stop that names a device is requeued as its message "
        "says: the node out (the fault's device flags dropped), resumed from what the stop saved",
    )
    p.add_argument(
        "--harm",
        type=float,
        default=HARM,
        help="harmful: the final loss this much over the clean twin's",
    )
    p.add_argument(
        "--preregister",
        help="a registration file: written before any run, checked on every later one",
    )
    p.add_argument(
        "--register_only",
        action="store_true",
        help="write --preregister's file and stop, so that it is committed before the first run",
    )
    p.add_argument("--report", action="store_true", help="only write the report of what has run")
    p.add_argument(
        "--baselines",
        help="with --report: another registration's --out whose remedy runs ran the same trials (the "
        "eighth's: the seventh's), used where both registrations' twins agree to every digit",
    )
    a = p.parse_args(argv)
    check_args(a)
    registration = preregister(a) if a.preregister and not a.report else None
    if a.register_only:
        if registration is None:
            raise SystemExit("--register_only needs --preregister FILE (the registration to write)")
        return
    if a.report and a.preregister:
        registration = json.load(open(a.preregister))
    if not a.report:
        campaign(a, registration)
    print(report(a.out, a.harm, registration, a.baselines))


def check_args(a):
    """One ValueError naming the flag and the fix, before any work."""
    if a.baselines and not a.report:
        raise ValueError(
            "--baselines goes with --report (it reads another registration's records): add --report"
        )
    if not a.report and not a.register_only and not a.data_path:
        raise ValueError(
            "--data_path is needed to run trials (a corpus with ids < 512; --report needs none)"
        )
    if (a.windows == "scaled") != (a.window_scale is not None):
        raise ValueError(
            "--window_scale goes with --windows scaled, and only with it: give both (every "
            "method's windows x the one factor) or neither (the published defaults)"
        )
    if a.window_scale is not None and not a.window_scale > 0:
        raise ValueError(
            f"--window_scale {a.window_scale} must be > 0 (every window x this factor)"
        )
    if a.windows == "sixth" and a.snapshots == "off":
        raise ValueError(
            "--snapshots off needs the seventh's rule (--windows published or scaled): the sixth's "
            "guard flags keep snapshots every 5 iterations"
        )
    longest = max(most for family, (_, most) in LONGER.items() if family != "lr slow persistent")
    if a.draw == "harm" and a.iters < longest + 25:
        raise ValueError(
            f"--draw harm's longer faults last up to {longest} iterations and start after 15: give "
            f"--iters {longest + 25} or more, not {a.iters}"
        )
    if a.draw == "withdrawn-61" and a.seed != 61:
        raise ValueError(
            f"--draw withdrawn-61 is the seed-61 registration's draw: give --seed 61, not {a.seed}"
        )


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad input: the message, exit 2 (the house convention)
        print(f"guard_campaign: {e}", file=sys.stderr)
        sys.exit(2)
