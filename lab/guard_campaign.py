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
method's actions, and is stamped with its UTC start and end, the commit, the tree and torch's
version.

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
"""

import argparse
import glob
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import torch

import guard_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
# family -> the cause a right diagnosis names. A family is a line here and a branch of draw() (a new one changes
# every trial's draw: a new registration, docs/spike_guard.md, section 9)
FAMILIES = {
    "lr transient": "optimizer",
    "lr persistent": "optimizer",
    "lr after resume": "optimizer",
    "lr slow persistent": "optimizer",
    "lost optimizer state": "optimizer",
    "random tokens": "data",
    "repeated token": "data",
    "repeated 8-gram": "data",
    "poisoned minority": "data",
    "ordered duplicate block": "data",
    "dp weight bit flip": "hardware",
    "dp grad bit flip": "hardware",
    "dp state bit flip": "hardware",
    "numerical bf16": "numerical",
    "numerical fp16": "numerical",
}
# fp32 exponent bits, counted from the lowest: 23, 24 x2 or x4; 28-30 x2^32 and more
BITS = [23, 24, 28, 29, 30]
CAUSES = ["data", "optimizer", "hardware", "numerical", "persistent", "none"]
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
METHODS = ["guard", "none", *REMEDIES]
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
# detects and never acts (Megatron-LM's spiky-loss check re-runs and reports; its restart is the
# operator's): it is reported as a detector, out of the remedies' table
DETECTORS = ("spiky_loss",)
# a fault is harmful when it raises the clean twin's final validation loss by more than this
HARM = 0.01
LOG = re.compile(
    r"^ iteration +(\d+)/ *\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|.*?"
    r"number of skipped iterations: +(\d+)",
    re.M,
)


def long_clean_seed(seed, j):
    """Long clean run j's training seed, drawn from the campaign seed as a trial's is (9000 + j made long run j
    the same run in every campaign)."""
    return random.Random(f"long clean {seed} {j}").randrange(10**4, 10**9)


def draw(seed, k, iters):
    """Trial k of the first six campaigns' draw (--draw sixth; its faults events in time), from
    (seed, k) alone: {family, flags (the fault's), precision (flags), seed, what (a description),
    start (the fault's first iteration), nproc (processes: 2 for a fault on one DP replica), resume
    (None, or the iteration K the run saves at and stops, a second process resuming from it with the
    fault's flags)}."""
    rng = random.Random(seed * 100_003 + k)
    family = rng.choice(sorted(FAMILIES))
    trial = fault_of(rng, family, rng.randint(15, iters - 20), iters)
    # The trial's training seed (initial weights, data order) is drawn too, last. It was 1234 + k:
    # trial k's clean twin was then the same run in every campaign whose draw gave it the same
    # precision and launch (16 of the sixth's first 28 were the fifth's bit for bit), so a
    # campaign's clean runs were not held out from the last's.
    return {**trial, "seed": rng.randrange(10**4, 10**9)}


def draw_withdrawn_61(seed, k, iters):
    """Trial k of the withdrawn seed-61 registration (7ec26c3; --draw withdrawn-61): the sixth's
    draw with the training seed it had then, 1234 + k, so that its trials can be run again and
    reported beside the new ones."""
    return {**draw(seed, k, iters), "seed": 1234 + k}


def fault_of(rng, family, start, iters):
    """The first six campaigns' fault of `family` from `start`, its magnitudes drawn from rng."""
    precision, nproc, resume = [], 1, None
    if family == "lr transient":
        length, factor = (
            rng.randint(1, 6),
            round(math.exp(rng.uniform(math.log(30), math.log(3000)))),
        )
        flags = [f"--inject_lr_iters={start}-{start + length - 1}", f"--inject_lr_factor={factor}"]
        what = f"LR x{factor} for {length}"
    # a higher LR from `start` to the end, on every pass, in one process
    elif family == "lr persistent":
        factor = round(math.exp(rng.uniform(math.log(10), math.log(100))))
        flags = [
            f"--inject_lr_iters={start}-{iters}",
            f"--inject_lr_factor={factor}",
            "--inject_lr_persistent",
        ]
        what = f"LR x{factor} from then on"
    # the run stops at K; its resume has the LR x factor from then on
    elif family == "lr after resume":
        resume = rng.randint(20, iters - 20)
        start, factor = resume + 1, round(math.exp(rng.uniform(math.log(10), math.log(100))))
        flags = [
            f"--inject_lr_iters={start}-{iters}",
            f"--inject_lr_factor={factor}",
            "--inject_lr_persistent",
        ]
        what = f"resumed at {resume} with LR x{factor}"
    # a slow harm: x20-40 from mid-run on (issue 41: x30 cost +3%)
    elif family == "lr slow persistent":
        start, factor = rng.randint(iters // 3, 2 * iters // 3), rng.randint(20, 40)
        flags = [
            f"--inject_lr_iters={start}-{iters}",
            f"--inject_lr_factor={factor}",
            "--inject_lr_persistent",
        ]
        what = f"LR x{factor} from then on"
    # the run stops at K; its resume finds Adam's moments zeroed
    elif family == "lost optimizer state":
        resume = rng.randint(20, iters - 20)
        start, flags, what = (
            resume + 1,
            [f"--inject_lost_optimizer_state_iter={resume + 1}"],
            f"resumed at {resume}",
        )
    elif family == "random tokens":
        length = rng.randint(1, 4)
        flags, what = (
            [f"--inject_bad_batch_iters={start}-{start + length - 1}"],
            f"{length} batches",
        )
    elif family in ("repeated token", "repeated 8-gram", "poisoned minority"):
        length = rng.randint(1, 4)
        kind = {
            "repeated token": "repeat",
            "repeated 8-gram": "ngram",
            "poisoned minority": "minority",
        }[family]
        fraction = rng.choice([0.125, 0.25, 0.375])
        flags = [
            f"--inject_degenerate_iters={start}-{start + length - 1}",
            f"--inject_degenerate_kind={kind}",
            f"--inject_degenerate_fraction={fraction}",
        ]
        what = f"{length} batches" + (
            f", {fraction:g} of the samples" if kind == "minority" else ""
        )
    # a shard of near-duplicates met in corpus order (BigScience, OPT)
    elif family == "ordered duplicate block":
        # 20-100 of 400
        length, period = rng.randint(20, 100) * iters // 400, rng.choice([1, 2, 4, 8])
        length = max(length, period)
        start = rng.randint(15, max(15, iters - length - 10))
        flags = [
            f"--inject_repeat_iters={start}-{start + length - 1}",
            f"--inject_repeat_period={period}",
        ]
        what = f"{length} iterations repeating {period} batches"
    # one DP replica of two: rank 1's gradient, weight or optimizer state
    elif family.startswith("dp "):
        target = {"dp weight bit flip": "weight", "dp grad bit flip": "grad"}.get(
            family
        ) or rng.choice(["exp_avg", "exp_avg_sq", "master"])
        bit, element, nproc = rng.choice(BITS), rng.randint(0, 10**6), 2
        flags = [
            f"--inject_bitflip_iters={start}-{start}",
            f"--inject_bitflip_bit={bit}",
            "--inject_bitflip_rank=1",
            f"--inject_bitflip_element={element}",
            f"--inject_bitflip_target={target}",
        ]
        what = f"bit {bit} of {target} element {element} on DP rank 1"
    else:  # numerical, in bf16 or fp16; in fp16 half of them early, while the loss scale searches
        half = family.split()[1]
        if half == "fp16" and rng.random() < 0.5:
            start = rng.randint(2, 14)
        length = rng.choice([1, 2, 5, 10, 21])
        flags, precision = [f"--inject_numerical_iters={start}-{start + length - 1}"], [f"--{half}"]
        what = f"{length} iterations"
    what = f"{family} at {start}: {what}"
    return {
        "family": family,
        "flags": flags,
        "precision": precision,
        "what": what,
        "start": start,
        "nproc": nproc,
        "resume": resume,
    }


# The seventh campaign's families: the sixth's, their data faults placed in the corpus
# (inject_bad_samples: met again by a rollback unless skipped), and a device that stays bad beside
# the transient bit flips
SEVENTH = {**FAMILIES, "dp bad device": "hardware"}
CORPUS_KINDS = {
    "random tokens": "random",
    "repeated token": "repeat",
    "repeated 8-gram": "ngram",
    "poisoned minority": "random",
    "ordered duplicate block": "duplicate",
}


def stratum(seed, k, families=SEVENTH):
    """Trial k's family in a stratified draw: each run of len(families) trials holds every family
    once, in an order drawn from (seed, the run's number), so that N x len(families) trials hold N
    of each."""
    order = sorted(families)
    random.Random(f"strata {seed} {k // len(order)}").shuffle(order)
    return order[k % len(order)]


def draw_seventh(seed, k, iters):
    """Trial k of the seventh campaign (--draw seventh), from (seed, k) alone, as draw(): its family
    stratified (stratum), its data faults in the corpus and its bad device staying bad
    (stability/faults.py)."""
    rng = random.Random(f"seventh {seed} {k}")
    return {**seventh_fault(rng, stratum(seed, k), iters), "seed": rng.randrange(10**4, 10**9)}


def seventh_fault(rng, family, iters):
    """The seventh's fault of `family`, its start and magnitudes drawn from rng: the first six's
    (fault_of), a data fault placed in the corpus, a bad device staying bad."""
    trial = fault_of(
        rng,
        family if family != "dp bad device" else "dp grad bit flip",
        rng.randint(15, iters - 20),
        iters,
    )
    trial["family"], trial["what"] = family, family + trial["what"][trial["what"].index(" at ") :]
    if family in CORPUS_KINDS:
        trial["flags"], trial["what"] = corpus_fault(rng, family, trial, iters)
    # the grad flip's bit, element and rank, from its start on and staying
    elif family == "dp bad device":
        trial["flags"][0] = f"--inject_bad_device_iter={trial['start']}"
        trial["what"] = trial["what"].replace(
            "on DP rank 1", "on DP rank 1's device, bad from then on"
        )
    return trial


# The ninth campaign's harm-first draw (--draw harm; docs/spike_guard.md, "The ninth campaign"): the
# seventh's families but those no severity tried made harmful at 2x64 (HARMLESS), each family's
# candidates screened in draw order (their clean and unremedied twins) until HARMFUL_EACH are harmful.
# Where the seventh's ranges did no harm in its first 176 trials, the candidates come from the longer
# ranges design runs found harmful (LONGER: batches, iterations or the LR's factor, least and most).
HARMLESS = ("lost optimizer state", "dp grad bit flip", "poisoned minority")
HARM_FIRST = {family: cause for family, cause in SEVENTH.items() if family not in HARMLESS}
LONGER = {
    "random tokens": (48, 128),
    "repeated token": (96, 160),
    "repeated 8-gram": (48, 128),
    "numerical fp16": (50, 120),
    "lr slow persistent": (35, 60),
}
HARMFUL_EACH = 10


def draw_harm(seed, k, iters):
    """Candidate k of the ninth's harm-first draw (--draw harm), from (seed, k) alone: its family
    stratified over HARM_FIRST, its fault the seventh's (seventh_fault) or, for LONGER's families,
    longer_fault's. Whether it runs is the screen's (campaign(): its family's earlier candidates)."""
    rng = random.Random(f"harm {seed} {k}")
    family = stratum(seed, k, HARM_FIRST)
    fault = longer_fault if family in LONGER else seventh_fault
    return {**fault(rng, family, iters), "seed": rng.randrange(10**4, 10**9)}


def longer_fault(rng, family, iters, batch=8):
    """A LONGER family's fault: its length (its LR factor, for the slow LR) drawn from LONGER's range,
    its start such that it ends 10 iterations before the run does; a data fault in the corpus."""
    least, most = LONGER[family]
    n = rng.randint(least, most)
    trial = {"family": family, "precision": [], "nproc": 1, "resume": None}
    if family == "lr slow persistent":  # the seventh's start, mid-run
        start = rng.randint(iters // 3, 2 * iters // 3)
        flags = [
            f"--inject_lr_iters={start}-{iters}",
            f"--inject_lr_factor={n}",
            "--inject_lr_persistent",
        ]
        what = f"LR x{n} from then on"
    else:
        start = rng.randint(15, iters - n - 10)
        if family == "numerical fp16":
            flags, what = [f"--inject_numerical_iters={start}-{start + n - 1}"], f"{n} iterations"
            trial["precision"] = ["--fp16"]
        else:
            (samples,) = corpus_samples(start, n, batch)
            flags = [
                f"--inject_bad_samples={samples}",
                f"--inject_bad_samples_kind={CORPUS_KINDS[family]}",
            ]
            what = f"{n} batches (samples {samples}, in the corpus)"
    return {**trial, "flags": flags, "what": f"{family} at {start}: {what}", "start": start}


def harmful_before(runs, family, k, first=0, harm=HARM):
    """How many of `family`'s candidates before k (from `first`) are harmful by their twins in
    `runs`: the ninth's screen runs candidate k of a family only while this is below HARMFUL_EACH."""
    twins = [(runs.get(f"{j}-clean"), runs.get(f"{j}-unguarded")) for j in range(first, k)]
    return sum(
        is_harmful(clean, bad, harm)
        for clean, bad in twins
        if clean and bad and clean["family"] == family
    )


def corpus_samples(start, n, batch=8, bad=None):
    """The consumed-sample ranges (inject_bad_samples') that n iterations from `start` read on their first
    pass (iteration i: samples (i - 1) x batch to i x batch - 1, one process, no ramp-up); with `bad`, only the
    first `bad` samples of each batch (a poisoned minority)."""
    first = (start - 1) * batch
    if bad is None:
        return [f"{first}-{first + n * batch - 1}"]
    return [f"{first + i * batch}-{first + i * batch + bad - 1}" for i in range(n)]


def corpus_fault(rng, family, trial, iters, batch=8):
    """(flags, what) of a data family placed in the corpus: the consumed samples that the fault's
    iterations of the first pass read (iteration n: samples (n - 1) x batch to n x batch - 1, one
    process, no ramp-up) made bad in place; a poisoned minority the first 1-3 of each batch's 8; a
    duplicate block repeating its first 1-8 batches' samples."""
    start, text = trial["start"], trial["what"]
    a, b = trial["flags"][0].split("=")[1].split("-")  # the sixth's iteration range of the fault
    length = int(b) - int(a) + 1
    ranges = corpus_samples(start, length, batch)
    if family == "poisoned minority":
        bad = rng.randint(1, 3)
        ranges = corpus_samples(start, length, batch, bad)
        text = text[: text.index(": ") + 2] + f"{length} batches, {bad} of their 8 samples"
    flags = [
        f"--inject_bad_samples={' '.join(ranges)}",
        f"--inject_bad_samples_kind={CORPUS_KINDS[family]}",
    ]
    if family == "ordered duplicate block":
        period = int(trial["flags"][1].split("=")[1])
        flags.append(f"--inject_duplicate_period={period * batch}")
    first, last = ranges[0].split("-")[0], ranges[-1].split("-")[1]
    return flags, text + f" (samples {first}-{last}, in the corpus)"


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
    resumes, the clean twin too: the fault is the only difference."""
    # on 2 processes the last one saves at the end with every rank's weights (dump_weights): replica_gap() reads them
    dumps = [f"--save={checkpoint}", "--dump_weights"] if trial["nproc"] > 1 else []
    # a guard without snapshots (--snapshots off) and the restarts go back to the disk checkpoints
    # their flags save, in `checkpoint`
    disk = [f"--save={checkpoint}"] if goes_to_disk(method) else []
    if trial["resume"] is None:
        return [[*base, *fault, *method, *disk, *dumps]]
    k = trial["resume"]
    saves = [f for f in method if f.startswith("--save_interval=")] or ["--save_interval=none"]
    return [
        [*base, *method, f"--save={checkpoint}", f"--save_interval={k}", f"--exit_interval={k}"],
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
        return [x for x in lines if x.startswith("spike guard:") and is_decision(x)]
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


def cause_of(line):
    # the DP replica check's decisions (replica_check.py) name no cause word: replicas that differ are hardware
    for key, cause in (
        ("persistent fault", "persistent"),
        ("hardware/transient", "hardware"),
        ("the DP replicas differ", "hardware"),
        ("take its node out", "hardware"),
        ("numerical: ", "numerical"),
        ("data-driven", "data"),
        ("optimizer-driven", "optimizer"),
    ):
        if key in line:
            return cause
    return "none"


def wilson(k, n, z=1.96):
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return (max(0.0, centre - half), min(1.0, centre + half))


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


def names(k, method):
    """(the faulted run's name, the clean run's name) of trial k under method: the guard's clean twin is the trial's
    reference for every method; a remedy's clean run is its own."""
    faulted = {"guard": f"{k}-guarded", "none": f"{k}-unguarded"}.get(method, f"{k}-{method}")
    return faulted, f"{k}-clean" if method in ("guard", "none") else f"{k}-clean-{method}"


def is_harmful(clean, unguarded, harm=HARM):
    """The harm threshold: the run died, its final validation loss is more than `harm` over the clean twin's, or
    (2 processes) its DP replicas ended with different weights -- rank 0's validation loss does not see a drifted
    rank 1 (a weight's bit 29 on rank 1: the same validation loss as the clean twin, the replicas apart)."""
    ratio = unguarded["valid"] / clean["valid"] if math.isfinite(unguarded["valid"]) else math.inf
    return unguarded["exit"] != 0 or not ratio <= 1 + harm or bool(unguarded.get("replica_gap"))


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
# The registration: what is frozen before any run


def stability_sha256():
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "stability", "*.py"))):
        digest.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read())
    return digest.hexdigest()


def source_sha256(functions):
    """The hash of these functions' source, in order: what a registration freezes of the draw's
    and the metrics' code."""
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()


def measured(harm):
    """What a registration freezes of how its runs are scored: the metrics' code, the goals and the
    thresholds (a report checks them against its own, check_measured)."""
    return {
        "metrics_sha256": source_sha256(MEASURED),
        "goals": GOALS,
        "harm_threshold": harm,
        "thresholds": {
            "detect_window": guard_metrics.DETECT_WINDOW,
            "loss_cap": guard_metrics.LOSS_CAP,
            "bootstrap": guard_metrics.BOOTSTRAP,
            "calibration": list(guard_metrics.CALIBRATION),
        },
    }


def check_measured(registration, harm):
    """Refuses to report a registration's runs with metrics, goals or thresholds other than the ones
    it froze: a report may come from a later checkout, but it scores the runs as registered."""
    if registration is None or "metrics_sha256" not in registration:
        return  # the sixth's and older registrations froze no metrics
    now = measured(harm)
    changed = [k for k in now if registration.get(k) != now[k]]
    if changed:
        raise SystemExit(
            f"this checkout scores runs differently from the registration ({', '.join(changed)} "
            f"changed since {registration['commit'][:7]}): report with the registered "
            f"lab/guard_metrics.py and lab/guard_campaign.py (git checkout "
            f"{registration['commit'][:7]} -- lab/guard_metrics.py lab/guard_campaign.py), "
            f"and --harm {registration['harm_threshold']}"
        )


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
DRAWS = {
    "seventh": draw_seventh,
    "sixth": draw,
    "withdrawn-61": draw_withdrawn_61,
    "harm": draw_harm,
}
# the seventh campaign's goals, frozen with it (a goal is met when its interval, not its estimate,
# is past it)
GOALS = {
    "damage removed (mean share; trials harmful by their loss)": ">= 0.8, the 95% interval above every remedy's mean",
    "trials ending worse than the unremedied twin by more than the harm threshold": "0",
    "replicas equal at the end (trials harmful by their replicas)": ">= 90%",
    "detected within the window, net of the clean-run base rate": ">= 90%",
    "clean runs with an action": "<= 1 in 100",
    "harmless faults stopped": "0",
    "harmful trials per family": ">= 10 (stratified draw; trials added, registered anew, where short)",
}


def code_stamp():
    """What every record and the registration carry of the code: the commit, the whole tree's state
    (tree_state) and torch's version."""
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"commit": git.stdout.strip(), **tree_state(), "torch": torch.__version__}


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


def registration_id(registration):
    if registration is None:
        return None
    return hashlib.sha256(json.dumps(registration, sort_keys=True).encode()).hexdigest()[:16]


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
        os.makedirs(os.path.dirname(os.path.abspath(a.preregister)), exist_ok=True)
        with open(a.preregister, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
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


def one_registration(runs, registration=None):
    """Refuses runs of several registrations (or of one and of none) in one report, and runs of another than
    `registration` (the --preregister file) when given."""
    ids = {r.get("registration") for r in runs.values()}
    if len(ids) > 1:
        raise SystemExit(
            f"the runs come from {len(ids)} registrations ({', '.join(map(str, sorted(ids, key=str)))}):"
            " report each campaign from its own --out"
        )
    if registration is not None and ids and ids != {registration_id(registration)}:
        raise SystemExit(
            f"the runs are of registration {ids.pop()}, not of --preregister's "
            f"{registration_id(registration)}"
        )


def runs_of(out):
    runs = {}
    for line in open(os.path.join(out, "runs.jsonl")):
        r = json.loads(line)
        runs[r["name"]] = r
    return runs


def trials_of(out):
    runs, trials = runs_of(out), []
    for k in sorted({r["trial"] for r in runs.values() if "trial" in r}):
        parts = [runs.get(f"{k}-{x}") for x in ("clean", "unguarded", "guarded")]
        if all(parts):
            trials.append(dict(zip(("clean", "unguarded", "guarded"), parts)))
    return trials


def report(out, harm=HARM, registration=None, baselines=None):
    """OUT/report.md (the tables) and OUT/campaign.png (the figure); returns the markdown. Refuses runs of more than
    one registration (one_registration). baselines: another registration's --out (beside_baselines)."""
    runs = runs_of(out)
    one_registration(runs, registration)
    check_measured(registration, harm)
    trials = trials_of(out)
    spent = sum(r.get("seconds", 0) * r.get("nproc", 1) for r in runs.values()) / 3600
    lines = [
        f"{len(trials)} complete trials (3 runs each; false positives: every finished clean run); "
        f"{spent:.1f} CPU-hours of run time (each run's wall time x its processes)",
        "",
    ]
    harmful, detected, right, diagnosed, within, rollbacks = 0, 0, 0, 0, 0, []
    matrix = {t: {c: 0 for c in CAUSES} for t in sorted(set(FAMILIES.values()))}
    # finished, their trial or not
    cleans = [r for name, r in runs.items() if name.endswith("-clean")]
    clean_iters, false_positives, rows = (
        sum(r["iters"] for r in cleans),
        sum(len(r["decisions"]) for r in cleans),
        [],
    )
    for t in trials:
        clean, bad, guarded = t["clean"], t["unguarded"], t["guarded"]
        ratio = bad["valid"] / clean["valid"] if math.isfinite(bad["valid"]) else math.inf
        harmful_here = is_harmful(clean, bad, harm)
        acts = [
            d
            for d in guarded["decisions"]
            if int(re.match(r"spike guard: iteration (\d+)", d)[1]) >= guarded["start"]
        ]
        true = SEVENTH[guarded["family"]]
        decided = cause_of(acts[0]) if acts else "none"
        if acts:
            matrix[true][decided] += 1
            diagnosed += 1
            right += decided == true
        g_ratio = guarded["valid"] / clean["valid"] if math.isfinite(guarded["valid"]) else math.inf
        if harmful_here:
            harmful += 1
            detected += bool(acts)
            within += g_ratio <= 1 + harm and not guarded.get("replica_gap")
            rollbacks.append(guarded["rollbacks"])
        rows.append(
            (
                guarded["family"],
                guarded["what"],
                harmful_here,
                decided,
                ratio,
                g_ratio,
                guarded["exit"],
                guarded["rollbacks"],
            )
        )

    def rate(k, n):
        lo, hi = wilson(k, n)
        return f"{k}/{n} = {k / n:.0%} (95% CI {lo:.0%}-{hi:.0%})" if n else "0/0"

    fp_runs = sum(bool(r["decisions"]) for r in cleans)
    fp_lo, fp_hi = wilson(false_positives, clean_iters)
    fp = 1000 * false_positives / max(clean_iters, 1)
    lines += [
        "| measure | goal | measured |",
        "|---|---|---|",
        f"| harmful faults detected | >= 90% | {rate(detected, harmful)} |",
        f"| diagnoses right (of the faults the guard acted on) | >= 85% | {rate(right, diagnosed)} |",
        f"| false positives per 1,000 clean iterations | <= 0.1 | {fp:.2f} ({false_positives} in {clean_iters}; "
        f"95% CI {1000 * fp_lo:.2f}-{1000 * fp_hi:.2f}) |",
        f"| clean runs with a decision (the run as the unit) | <= 1 in 100 | {rate(fp_runs, len(cleans))} |",
        f"| guarded final loss within 1% of the clean twin's (harmful faults) | >= 80% | "
        f"{rate(within, harmful)} |",
        f"| rollbacks per harmful fault | <= 1 | mean {sum(rollbacks) / max(len(rollbacks), 1):.2f}, max "
        f"{max(rollbacks, default=0)} |",
        "",
        "Diagnosis (rows: the true cause; columns: the cause of the guard's first decision at or after the "
        "fault's start):",
        "",
        "| true \\ decided | " + " | ".join(CAUSES) + " |",
        "|---|" + "---|" * len(CAUSES),
    ]
    lines += [f"| {t} | " + " | ".join(str(matrix[t][c]) for c in CAUSES) + " |" for t in matrix]
    lines += [
        "",
        "| fault | harmful | decided | unguarded / clean | guarded / clean | exit | rollbacks |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {w} | {'yes' if h else 'no'} | {d} | {r:.3f} | {g:.3f} | {e} | {rb} |"
        for f, w, h, d, r, g, e, rb in rows
    ]
    if any(r.get("method") not in (None, "guard", "none") for r in runs.values()):
        lines += [
            "",
            "Methods on the same faults (each remedy runs the harmful trials and its own clean runs; the "
            "guard's clean runs are the clean twins):",
            "",
            method_table(runs, harm),
        ]
    lines += [
        "",
        "The primary metric and the costs (lab/guard_metrics.py; a rollback's replays "
        "count as iterations run):",
        "",
        primary_table(runs, harm),
        worse_than_nothing(runs, out, harm),
    ]
    if baselines:
        lines += ["", *beside_baselines(out, baselines, harm)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    figure(rows, os.path.join(out, "campaign.png"))
    return text


def acts_from(record, start):
    """The actions of a run at or after the fault's start (each action's line names its iteration)."""
    return [d for d in record["decisions"] if int(re.search(r"iteration (\d+)", d)[1]) >= start]


def right_diagnosis(method, act, family):
    """Whether the method's first action names the fault's cause, where the method says one: the guard's cause;
    Megatron's re-run tells a transient (hardware) fault from a reproducible one (not hardware). None elsewhere."""
    true = SEVENTH[family]
    if method == "guard":
        return cause_of(act) == true
    if method == "spiky_loss":
        return ("not reproducible" in act) == (true == "hardware")
    return None


def rate(k, n):
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {k / n:.0%} ({lo:.0%}-{hi:.0%})" if n else "-"


def method_results(runs, harm=HARM):
    """{method: its numbers} over the trials whose clean twin and unguarded run are in: on the harmful ones, its
    faulted runs (detected, right diagnosis, final validation loss / the clean twin's); its clean runs (runs with
    an action, actions per iteration); per fault class, detected of harmful."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    harmful = [k for k in ks if is_harmful(runs[f"{k}-clean"], runs[f"{k}-unguarded"], harm)]
    results = {}
    for method in METHODS:
        out = {
            "n": 0,
            "detected": 0,
            "diagnosed": 0,
            "right": 0,
            "within": 0,
            "ratios": [],
            "classes": {},
        }
        for k in harmful:
            run, clean = runs.get(names(k, method)[0]), runs[f"{k}-clean"]
            if run is None:
                continue
            acts = acts_from(run, run["start"])
            ratio = (
                run["valid"] / clean["valid"]
                if math.isfinite(run["valid"]) and run["exit"] == 0
                else math.inf
            )
            right = right_diagnosis(method, acts[0], run["family"]) if acts else None
            within = ratio <= 1 + harm and not run.get("replica_gap")
            cls = out["classes"].setdefault(run["family"], [0, 0, 0])  # detected, harmful, within
            cls[0], cls[1], cls[2] = cls[0] + bool(acts), cls[1] + 1, cls[2] + within
            out["n"], out["detected"] = out["n"] + 1, out["detected"] + bool(acts)
            out["ratios"].append(ratio)
            out["diagnosed"], out["right"] = (
                out["diagnosed"] + (right is not None),
                out["right"] + bool(right),
            )
            out["within"] += within
        cleans = [
            runs[names(k, method)[1]]
            for k in ks
            if names(k, method)[1] in runs and method != "none"
        ]
        cleans += [r for name, r in runs.items() if name.startswith("long") and method == "guard"]
        out["clean_runs"], out["fp_runs"] = len(cleans), sum(bool(r["decisions"]) for r in cleans)
        out["clean_iters"] = sum(r["iters"] for r in cleans)
        out["fp_actions"] = sum(len(r["decisions"]) for r in cleans)
        results[method] = out
    return results


def method_table(runs, harm=HARM):
    """The markdown of methods x (detection, false positives, right diagnosis, damage), then detection per fault
    class, each rate with its 95% Wilson interval."""
    results = method_results(runs, harm)
    lines = [
        f"| method | harmful faults detected | clean runs with an action (false positives) | false positives per "
        f"1,000 clean iterations | right diagnosis | final loss within {harm:.0%} of the clean twin | median "
        "final / clean |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        if not r["n"] and not r["clean_runs"]:
            continue
        lo, hi = wilson(r["fp_actions"], r["clean_iters"])
        fp = (
            f"{1000 * r['fp_actions'] / r['clean_iters']:.2f} ({1000 * lo:.2f}-{1000 * hi:.2f})"
            if r["clean_iters"]
            else "-"
        )
        ratios = sorted(r["ratios"])
        median = f"{ratios[len(ratios) // 2]:.3f}" if ratios else "-"
        lines.append(
            f"| {method} | {rate(r['detected'], r['n']) if method != 'none' else '-'} | "
            f"{rate(r['fp_runs'], r['clean_runs'])} | {fp} | {rate(r['right'], r['diagnosed'])} | "
            f"{rate(r['within'], r['n'])} | {median} |"
        )
    shown = [m for m in METHODS if m != "none" and results[m]["n"]]
    classes = sorted({c for m in shown for c in results[m]["classes"]})
    lines += [
        "",
        "Harmful faults detected, per fault class:",
        "",
        "| fault class | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    lines += [
        f"| {c} | "
        + " | ".join(rate(*results[m]["classes"].get(c, (0, 0))[:2]) for m in shown)
        + " |"
        for c in classes
    ]
    # where a remedy beats the guard is a class's damage, not its detection: an action that does not undo the harm
    lines += [
        "",
        f"Harmful faults ending within {harm:.0%} of the clean twin, per fault class:",
        "",
        "| fault class | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    lines += [
        f"| {c} | "
        + " | ".join(
            rate(
                results[m]["classes"].get(c, (0, 0, 0))[2],
                results[m]["classes"].get(c, (0, 0, 0))[1],
            )
            for m in shown
        )
        + " |"
        for c in classes
    ]
    return "\n".join(lines) + "\n"


def primary_results(runs, harm=HARM):
    """{method: its seventh-campaign numbers} over the trials whose clean twin and unremedied run
    are in: the share of the damage removed per trial harmful by its loss; replicas equal where the
    unremedied run's ended apart; detections within the window and the base rate of its clean runs;
    the costs; actions and stops on harmless faults (where the method ran them)."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    ref = {k: (runs[f"{k}-clean"], runs[f"{k}-unguarded"]) for k in ks}
    harmful = [k for k in ks if is_harmful(*ref[k], harm)]
    results = {}
    for method in METHODS:
        out = {
            "shares": [],
            "apart": 0,
            "rejoined": 0,
            "harmful": 0,
            "detected": 0,
            "costs": [],
            "harmless": 0,
            "harmless_acted": 0,
            "harmless_stopped": 0,
        }
        for k in ks:
            run = runs.get(names(k, method)[0])
            if run is None or method == "none":
                continue
            clean, bad = ref[k]
            out["costs"].append(guard_metrics.costs(run, bad))
            if k not in harmful:
                out["harmless"] += 1
                out["harmless_acted"] += bool(acts_from(run, run["start"]))
                out["harmless_stopped"] += run["exit"] != 0
                continue
            out["harmful"] += 1
            out["detected"] += guard_metrics.acted_within(run, run["start"])
            share = guard_metrics.damage_removed(clean, bad, run)
            if share is not None and is_harmful(clean, {**bad, "replica_gap": None}, harm):
                out["shares"].append(share)
            if bad.get("replica_gap"):
                out["apart"], out["rejoined"] = (
                    out["apart"] + 1,
                    out["rejoined"] + (run.get("replica_gap") == 0),
                )
        cleans = [
            runs[names(k, method)[1]]
            for k in ks
            if names(k, method)[1] in runs and method != "none"
        ]
        cleans += [r for name, r in runs.items() if name.startswith("long") and method == "guard"]
        out["base"] = guard_metrics.base_rate(
            cleans, [runs[f"{k}-unguarded"]["start"] for k in harmful]
        )
        results[method] = out
    return results


def primary_table(runs, harm=HARM):
    """The markdown of methods x (damage removed with its bootstrap interval, trials worse than
    doing nothing, replicas, detection net of the base rate, costs, harmless faults acted on and
    stopped); detectors apart."""
    w = guard_metrics.DETECT_WINDOW
    lines = [
        "| method | damage removed: mean share (95% bootstrap) | worse than doing nothing | "
        "replicas equal where the unremedied ended apart | detected within "
        f"{w} iterations - clean base rate | iterations run | wall time | snapshots held | "
        "harmless faults acted on / stopped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in primary_results(runs, harm).items():
        if not r["harmful"] and not r["harmless"]:
            continue
        mean, lo, hi = guard_metrics.bootstrap_mean(r["shares"])
        shares = f"{mean:.2f} ({lo:.2f} to {hi:.2f}), n={len(r['shares'])}" if r["shares"] else "-"
        worse = sum(x < 0 for x in r["shares"])
        net = (
            r["detected"] / r["harmful"] - r["base"]
            if r["harmful"] and math.isfinite(r["base"])
            else math.nan
        )
        steps, wall, held = (sum(c[i] for c in r["costs"]) / len(r["costs"]) for i in range(3))
        name = method + (" (detects, never acts)" if method in DETECTORS else "")
        lines.append(
            f"| {name} | {shares} | {worse} | {r['rejoined']}/{r['apart']} | "
            f"{r['detected']}/{r['harmful']} - {r['base']:.2f} = {net:+.2f} | {steps:+.1%} | "
            f"{wall:+.1%} | "
            f"{held:.1f} | {r['harmless_acted']}/{r['harmless']} / {r['harmless_stopped']}"
            f"/{r['harmless']} |"
        )
    lines += [
        "",
        "Harmful trials per family (the goal: >= 10 each):",
        "",
        "| family | trials | harmful |",
        "|---|---|---|",
    ]
    for family in sorted({r["family"] for r in runs.values() if r.get("family")}):
        ks = {
            r["trial"]
            for r in runs.values()
            if r.get("family") == family
            and f"{r['trial']}-clean" in runs
            and f"{r['trial']}-unguarded" in runs
        }
        bad = sum(is_harmful(runs[f"{k}-clean"], runs[f"{k}-unguarded"], harm) for k in ks)
        lines.append(f"| {family} | {len(ks)} | {bad} |")
    return "\n".join(lines) + "\n"


def same_twins(mine, theirs):
    """Trial numbers whose clean and unremedied runs are in both records and agree to every recorded
    digit (exit, final loss, every logged loss and grad norm): the runs the two registrations share."""

    def key(r):
        return (r["exit"], repr(r["valid"]), r["series"])

    ks = {r["trial"] for r in mine.values() if "trial" in r}
    return sorted(
        k
        for k in ks
        if all(
            f"{k}-{x}" in mine
            and f"{k}-{x}" in theirs
            and key(mine[f"{k}-{x}"]) == key(theirs[f"{k}-{x}"])
            for x in ("clean", "unguarded")
        )
    )


def beside_baselines(out, baselines, harm=HARM):
    """The primary table of this registration's guard beside another registration's remedy runs of the
    same trials (the eighth's guard, the seventh's remedies), on the trials whose twins both hold and
    agree to every digit (same_twins); each registration's records checked against its own file
    (BASELINES/registration.json), metrics included. Markdown lines."""
    theirs_file = os.path.join(baselines, "registration.json")
    theirs_reg = json.load(open(theirs_file)) if os.path.exists(theirs_file) else None
    mine, theirs = runs_of(out), runs_of(baselines)
    one_registration(theirs, theirs_reg)
    check_measured(theirs_reg, harm)
    agree = same_twins(mine, theirs)
    ks = sorted({r["trial"] for r in mine.values() if "trial" in r})
    apart = [k for k in ks if k not in agree]
    merged = {n: r for n, r in mine.items() if r.get("trial") in agree or "trial" not in r}
    merged.update(
        (n, r)
        for n, r in theirs.items()
        if r.get("trial") in agree and r.get("method") not in (None, "guard", "none")
    )
    return [
        f"Beside the remedies of {baselines} (registration {registration_id(theirs_reg)}): "
        f"{len(agree)} of {len(ks)} trials, whose clean and unremedied runs agree to every recorded "
        "digit in both registrations"
        + (f"; apart (no baseline): {', '.join(map(str, apart))}" if apart else "")
        + ":",
        "",
        primary_table(merged, harm),
    ]


def ending(out, record):
    """How a run ended, in words: finished, stopped by the guard (its stop line names the cause;
    torchrun turns a worker's exit 3 into its own 1), or died. The stop line is read from the run's
    log where it is kept (OUT/logs, not committed); from the record alone, the last action's cause."""
    if record.get("requeued"):
        r = record["requeued"]
        then = "finished" if record["exit"] == 0 else f"failed again (exit {record['exit']})"
        return (
            f"stopped by the guard at iteration {r['iteration']}, {r['cause']}; requeued without DP rank "
            f"{r['dp_rank']}'s device, {then}"
        )
    if record["exit"] == 0:
        return "finished"
    log = os.path.join(out, "logs", f"{record['name']}.log")
    if os.path.exists(log):
        lines = open(log, errors="replace").read().splitlines()
        stops = [x for x in lines if x.startswith("error: spike guard: iteration")]
        if stops:
            it = re.match(r"error: spike guard: iteration (\d+)", stops[-1])[1]
            return f"stopped by the guard at iteration {it}, {cause_of(stops[-1])} (exit {record['exit']})"
        errors = [x for x in lines if re.match(r"\w*(Error|error)\b", x)]
        return f"died (exit {record['exit']}): {errors[-1][:80] if errors else 'no error line'}"
    last = cause_of(record["decisions"][-1]) if record["decisions"] else "none"
    return f"exit {record['exit']}, its last action's cause {last} (no log)"


def worse_than_nothing(runs, out, harm=HARM):
    """The markdown list of every trial in which a method ended measurably worse than doing nothing:
    its final loss (a run that did not finish scored as LOSS_CAP) more than `harm` over the
    unremedied twin's, or its DP replicas apart where the unremedied run's ended equal; with how it
    ended. Beside the registered metrics, not one of them: it names where, the table counts."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    rows = []
    for method in ["guard", *REMEDIES]:
        for k in ks:
            run, bad = runs.get(names(k, method)[0]), runs[f"{k}-unguarded"]
            if run is None:
                continue
            mine, theirs = guard_metrics.final_loss(run), guard_metrics.final_loss(bad)
            apart = bool(run.get("replica_gap")) and not bad.get("replica_gap")
            if mine > theirs * (1 + harm) or apart:
                rows.append(
                    f"| {method} | {k} | {run['family']} | {theirs:.4f} | {mine:.4f} | "
                    f"{'apart' if apart else 'equal' if run.get('replica_gap') == 0 else '-'} | "
                    f"{ending(out, run)} |"
                )
    head = [
        f"Trials in which a method ended more than {harm:.0%} worse than doing nothing (final loss; "
        f"a run that did not finish scored as ln(512) = {guard_metrics.LOSS_CAP:.4f}), or with its "
        "replicas apart where doing nothing kept them equal:",
        "",
        "| method | trial | family | unremedied final loss | its final loss | replicas | how it ended |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + (rows or ["| none | | | | | | |"])) + "\n"


# the code a registration hashes as its metrics
MEASURED = (
    is_harmful,
    acts_from,
    primary_results,
    primary_table,
    guard_metrics.final_loss,
    guard_metrics.damage_removed,
    guard_metrics.bootstrap_mean,
    guard_metrics.acted_within,
    guard_metrics.base_rate,
    guard_metrics.percentile,
    guard_metrics.calibrated_bound,
    guard_metrics.costs,
)


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (_, _, harmful, _, ratio, g_ratio, _, _) in enumerate(rows):
        clip = lambda v: min(v, 1.5) if math.isfinite(v) else 1.5  # noqa: E731 (a diverged run drawn at the top)
        ax.plot([k, k], [clip(ratio), clip(g_ratio)], color="0.8", zorder=1)
        ax.scatter([k], [clip(ratio)], marker="x", color="tab:red" if harmful else "0.5", zorder=2)
        ax.scatter(
            [k], [clip(g_ratio)], marker="o", facecolors="none", edgecolors="tab:blue", zorder=3
        )
    ax.axhline(1.01, color="k", lw=0.5, ls="--")
    ax.set_xlabel("trial (x: unguarded, red if harmful; o: guarded)")
    ax.set_ylabel("final validation loss / clean twin's (clipped at 1.5)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
