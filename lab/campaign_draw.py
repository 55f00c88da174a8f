"""The campaign's fault space and its draws (docs/spike_guard.md, section 9, "The campaign"): the fault
families, each trial's fault drawn from the campaign's seed and the trial's number alone, and what harm is. A
registration hashes these functions' source (guard_campaign.DRAWN): changing one is a new registration.
"""

import math
import random

# a fault is harmful when it raises the clean twin's final validation loss by more than this
HARM = 0.01
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


def is_harmful(clean, unguarded, harm=HARM):
    """The harm threshold: the run died, its final validation loss is more than `harm` over the clean twin's, or
    (2 processes) its DP replicas ended with different weights -- rank 0's validation loss does not see a drifted
    rank 1 (a weight's bit 29 on rank 1: the same validation loss as the clean twin, the replicas apart)."""
    ratio = unguarded["valid"] / clean["valid"] if math.isfinite(unguarded["valid"]) else math.inf
    return unguarded["exit"] != 0 or not ratio <= 1 + harm or bool(unguarded.get("replica_gap"))


DRAWS = {
    "seventh": draw_seventh,
    "sixth": draw,
    "withdrawn-61": draw_withdrawn_61,
    "harm": draw_harm,
}
