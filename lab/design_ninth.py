"""DESIGN runs for the ninth campaign's draw (docs/spike_guard.md, "The ninth campaign"): how long or how far from
the campaign's LR must a fault family be to harm the campaign's 2x64 model? No method, no registration: one run
of each fault and one clean twin per LR, precision and launch, n = 1 each. Re-runnable and resumable:

    python lab/design_ninth.py --data_path DATA       # runs what lab/campaign/ninth-design/runs.jsonl lacks
    python lab/design_ninth.py --table                # the docs' table, from the records

Each run is the campaign's own (guard_campaign.base_args, processes: the tests' corpus512, 400 iterations, a fault
on one DP replica on 2 gloo processes, a lost optimizer state as a resume) with one training seed, SEED, and no
method; a fault's harm is its final validation loss over its clean twin's (same LR, precision, launch), in percent.
The ninth's longer ranges (campaign_draw.LONGER) and its harmless families (HARMLESS) were set from these.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import campaign_draw as cd  # noqa: E402
import guard_campaign as gc  # noqa: E402

OUT = os.path.join(HERE, "campaign", "ninth-design")
SEED, ITERS, BATCH = 12345, 400, 8
LRS = (None, 1e-2, 3e-2)  # None: the campaign's own, 2e-3


def corpus(kind, start, n, bad=None):
    """Samples of n batches from iteration `start` bad in the corpus; a poisoned minority: the first `bad` of
    each batch's 8."""
    ranges = cd.corpus_samples(start, n, BATCH, bad)
    return [f"--inject_bad_samples={' '.join(ranges)}", f"--inject_bad_samples_kind={kind}"]


def grad_flip(start, n, bit):
    return [
        f"--inject_bitflip_iters={start}-{start + n - 1}",
        f"--inject_bitflip_bit={bit}",
        "--inject_bitflip_rank=1",
        "--inject_bitflip_element=12345",
        "--inject_bitflip_target=grad",
    ]


# name -> (launch: "" / "fp16" / "dp" / a resume iteration, the fault's flags); a name's clean twin is
# "clean" + its launch's suffix
CASES = {
    **{
        f"{name}-{start}x{n}": ("", corpus(kind, start, n))
        for name, kind in (("random", "random"), ("repeat", "repeat"), ("ngram", "ngram"))
        for start, n in ((200, 16), (300, 16), (200, 64), (320, 40), (100, 4), (250, 4))
    },
    **{
        f"minority-{start}x{n}b3": ("", corpus("random", start, n, bad=3))
        for start, n in ((200, 64), (300, 64), (100, 4), (250, 4))
    },
    **{
        f"fp16-{start}x{n}": ("fp16", [f"--inject_numerical_iters={start}-{start + n - 1}"])
        for start, n in ((100, 50), (200, 100), (300, 60))
    },
    **{
        f"lostopt-{k}": (k, [f"--inject_lost_optimizer_state_iter={k + 1}"]) for k in (50, 200, 350)
    },
    **{
        f"dpgrad-{start}x{n}b{bit}": ("dp", grad_flip(start, n, bit))
        for start, n, bit in ((200, 1, 30), (200, 20, 30), (200, 20, 29))
    },
}
# the cases run at 5x and 15x the LR too: the short ones, near the edge of stability
AT_EVERY_LR = [
    "random-100x4",
    "random-250x4",
    "repeat-100x4",
    "repeat-250x4",
    "ngram-100x4",
    "ngram-250x4",
    "minority-100x4b3",
    "minority-250x4b3",
    "fp16-100x50",
    "lostopt-200",
    "dpgrad-200x1b30",
]
# the docs' table: (its fault column, the cases of each LR column: a list, a case's alternatives in parentheses)
ROWS = [
    ("random tokens in the corpus, 4 batches at 100 / 250", "random-100x4 random-250x4"),
    (
        "random tokens, 16 batches at 200 / 300; 64 at 200; 40 at 320",
        "random-200x16 random-300x16; random-200x64; random-320x40",
    ),
    ("a repeated token, 4 batches at 100 / 250", "repeat-100x4 repeat-250x4"),
    (
        "a repeated token, 16 at 200 / 300; 64 at 200; 40 at 320",
        "repeat-200x16 repeat-300x16; repeat-200x64; repeat-320x40",
    ),
    ("a repeated 8-gram, 4 batches at 100 / 250", "ngram-100x4 ngram-250x4"),
    (
        "a repeated 8-gram, 16 at 200 / 300; 64 at 200; 40 at 320",
        "ngram-200x16 ngram-300x16; ngram-200x64; ngram-320x40",
    ),
    (
        "a poisoned minority (3 of 8 samples), 4 batches at 100 / 250",
        "minority-100x4b3 minority-250x4b3",
    ),
    ("a poisoned minority, 64 batches at 200 / 300", "minority-200x64b3 minority-300x64b3"),
    ("an fp16 overflow burst, 50 iterations at 100", "fp16-100x50"),
    ("an fp16 overflow burst, 100 iterations at 200; 60 at 300", "fp16-200x100; fp16-300x60"),
    (
        "lost optimizer state, resumed at 200 (and at 50 / 350)",
        "lostopt-200 (lostopt-50 lostopt-350)",
    ),
    (
        "a grad bit flip on DP rank 1, bit 30 once (bit 30 / 29 for 20 iterations)",
        "dpgrad-200x1b30 (dpgrad-200x20b30 dpgrad-200x20b29)",
    ),
]


def trial(launch):
    """The campaign's trial dict for a launch: one process, fp16, two DP replicas, or a resume at K."""
    return {
        "precision": ["--fp16"] if launch == "fp16" else [],
        "nproc": 2 if launch == "dp" else 1,
        "resume": launch if isinstance(launch, int) else None,
        "seed": SEED,
    }


def clean_of(launch):
    """A case's clean twin: the same precision and launch (a resumed run's is the run without the resume: a resume
    is bit-exact)."""
    return "clean" + (
        {"fp16": "-fp16", "dp": "-dp"}.get(launch, "") if launch in ("fp16", "dp") else ""
    )


def runs(lr):
    """(name, launch, fault flags) of every run at `lr`, the clean twins first: at the campaign's LR every case but
    the 4-batch data faults (the seventh's own 1-4 batches ran there), at the others AT_EVERY_LR."""
    short = [c for c in AT_EVERY_LR if c.split("-")[0] in ("random", "repeat", "ngram", "minority")]
    names = [c for c in CASES if c not in short] if lr is None else AT_EVERY_LR
    launches = {"": [], "fp16": [], "dp": []}
    out = [(clean_of(launch), launch, []) for launch in launches]
    return out + [(name, CASES[name][0], CASES[name][1]) for name in names]


def argv(name, launch, fault, lr, checkpoint):
    """The run's processes' argument lists (guard_campaign.processes: a resume is two)."""
    t = trial(launch)
    base = [*gc.base_args(t, "2x64", ITERS), *([f"--lr={lr}"] if lr else [])]
    return gc.processes(base, fault, [], t, checkpoint)


def key(name, lr):
    return f"{name}@{lr or 'campaign'}"


def records(out=OUT):
    path = os.path.join(out, "runs.jsonl")
    if not os.path.exists(path):
        return {}
    return {key(r["name"], r["lr"]): r for r in map(json.loads, open(path))}


def run(data_path, out=OUT):
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    done = records(out)
    for lr in LRS:
        for name, launch, fault in runs(lr):
            if key(name, lr) in done:
                continue
            tag = key(name, lr).replace("@", "-lr")
            parts = argv(name, launch, fault, lr, os.path.join(out, "checkpoints", tag))
            r = gc.run_one(out, tag, parts, data_path, "none", trial(launch)["nproc"])
            record = {k: r[k] for k in ("exit", "valid", "replica_gap")}
            record = {"name": name, "lr": lr, **record, "flags": fault, "launch": launch}
            with open(os.path.join(out, "runs.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            print(
                f"design_ninth: {key(name, lr)}: exit {r['exit']}, valid {r['valid']}", flush=True
            )


def harm(recs, name, lr):
    """The case's final loss over its clean twin's, in percent, as the docs write it ("" where not run)."""
    r = recs.get(key(name, lr))
    if r is None:
        return ""
    clean = recs[key(clean_of(CASES[name][0]), lr)]
    pct = 100 * (r["valid"] / clean["valid"] - 1)
    text = f"{pct:+.2f}%"
    return f"**{text}**" if pct > 100 * cd.HARM else text


def cell(recs, cases, lr):
    """One table cell: the cases' harms as ROWS writes them (" / " between cases, "; " between groups, the
    alternatives in parentheses); the cases not run at this LR left out, an empty cell where none ran."""

    def joined(names):
        found = [harm(recs, c, lr) for c in names.split()]
        return " / ".join(found) if all(found) else ""

    groups = []
    for group in cases.split("; "):
        head, _, alt = group.partition(" (")
        text, alternatives = joined(head), joined(alt.rstrip(")"))
        groups.append(text + (f" ({alternatives})" if text and alternatives else ""))
    return "; ".join(g for g in groups if g)


SEVENTH_COLUMN = {  # the campaign's LR column where the seventh's own range ran: its count, not a design run
    "random tokens in the corpus, 4 batches at 100 / 250": "(the seventh's 1-4: 0 of 11 harmful)",
    "a repeated token, 4 batches at 100 / 250": "(0 of 11)",
    "a repeated 8-gram, 4 batches at 100 / 250": "(0 of 11)",
    "a poisoned minority (3 of 8 samples), 4 batches at 100 / 250": "(0 of 11)",
}


def table(recs):
    lines = [
        "| fault | LR 2e-3 (the campaign's) | LR 1e-2 | LR 3e-2 |",
        "| --- | --- | --- | --- |",
    ]
    for fault, cases in ROWS:
        cells = [SEVENTH_COLUMN.get(fault) or cell(recs, cases, None)]
        cells += [cell(recs, cases, lr) for lr in LRS[1:]]
        lines.append(f"| {fault} | " + " | ".join(cells) + " |")
    # an empty cell as markdown writes it
    lines = [line.replace("|  |", "| |").replace("|  |", "| |") for line in lines]
    return "\n".join(lines)


def main(argv_=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_path", help="the tests' corpus512 (ids < 512): needed to run")
    p.add_argument("--out", default=OUT)
    p.add_argument(
        "--table", action="store_true", help="only print the docs' table from the records"
    )
    a = p.parse_args(argv_)
    if not a.table:
        if not a.data_path:
            raise SystemExit("design_ninth: --data_path is needed to run (a corpus with ids < 512)")
        run(a.data_path, a.out)
    print(table(records(a.out)))


if __name__ == "__main__":
    main()
