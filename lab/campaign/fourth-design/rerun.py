"""DESIGN numbers, not held out: chosen trials of the fourth campaign (lab/campaign/fourth, registration
3c69998fb9d9d0ff) re-run with this tree's guard -- the guarded run of a trial (`K:guarded`) or its clean twin, guarded
(`K:clean`) -- from the campaign's own trial definitions (guard_campaign.draw, base_args, processes, run_one), then
compared with the recorded clean twins and unguarded runs (report()). The fourth campaign's records were studied to
change the guard, so these numbers say what the change does on the trials it was designed on; held-out numbers need
a fifth campaign, registered after the change.

    TREE=<a copy of the tree> python lab/campaign/fourth-design/rerun.py OUT DATA512 9:guarded 43:clean ...
    python lab/campaign/fourth-design/rerun.py --report OUT

TREE: the tree whose train.py runs (a copy, so that editing the worktree cannot change runs under way); JOBS runs at a
time (a 2-process run holds two)."""

import json
import math
import os
import re
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TREE", os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, os.path.join(ROOT, "lab"))
import guard_campaign as gc  # noqa: E402

FOURTH = os.path.join(os.path.dirname(HERE), "fourth")
REG = json.load(open(os.path.join(FOURTH, "registration.json")))


class Args:
    model = REG["model"]


def trial_of(k):
    return {
        "trial": k,
        **gc.draw(REG["seed"], k, REG["iters"]),
        "model": gc.model_of(Args, k),
        "iters": REG["iters"],
    }


def rerun(out, data, jobs):
    """Each (k, kind) not yet in OUT/runs.jsonl run once, JOBS processes at a time."""
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    path = os.path.join(out, "runs.jsonl")
    done = gc.runs_of(out) if os.path.exists(path) else {}
    width = int(os.environ.get("JOBS", "2"))
    lock, slots, threads = threading.Lock(), threading.Semaphore(width), []

    def one(k, kind, held):
        try:
            trial, name, t0 = trial_of(k), f"{k}-{kind}", time.time()
            base = gc.base_args(trial, trial["model"], REG["iters"])
            parts = gc.processes(
                base,
                trial["flags"] if kind == "guarded" else [],
                gc.GUARD,
                trial,
                os.path.join(out, "checkpoints", name),
            )
            record = {
                **gc.run_one(out, name, parts, data, "guard", trial["nproc"]),
                **{
                    key: trial[key]
                    for key in ("trial", "family", "what", "start", "model", "iters")
                },
                "seconds": round(time.time() - t0, 1),
            }
            with lock:
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            print(
                f"{name} ({trial['what']}): exit {record['exit']}, valid {record['valid']:.4f}, "
                f"{len(record['decisions'])} actions, {record['seconds']} s",
                flush=True,
            )
        finally:
            for _ in range(held):
                slots.release()

    for k, kind in jobs:
        if f"{k}-{kind}" not in done:
            held = min(trial_of(k)["nproc"], width)
            for _ in range(held):
                slots.acquire()
            threads.append(threading.Thread(target=one, args=(k, kind, held)))
            threads[-1].start()
    for t in threads:
        t.join()


def measures(label, guarded, clean, harmful, cleans, recorded):
    """The report's measures over these trials: the guarded runs of the harmful ones, and the clean twins."""
    detected = right = diagnosed = within = 0
    rollbacks, rows = [], []
    for k in harmful:
        c, u, g = recorded[f"{k}-clean"], recorded[f"{k}-unguarded"], guarded(k)
        acts = gc.acts_from(g, g["start"])
        ratio = g["valid"] / c["valid"] if math.isfinite(g["valid"]) else math.inf
        ok = ratio <= 1 + gc.HARM and not g.get("replica_gap")
        detected, within = detected + bool(acts), within + ok
        rollbacks.append(g["rollbacks"])
        if acts:
            diagnosed, right = (
                diagnosed + 1,
                right + (gc.cause_of(acts[0]) == gc.FAMILIES[g["family"]]),
            )
        rows.append(
            f"| {g['what']} | {gc.cause_of(acts[0]) if acts else 'none'} | {u['valid'] / c['valid']:.3f} | "
            f"{ratio:.3f} | {g['exit']} | {g['rollbacks']} |"
        )
    runs = [clean(k) for k in cleans]
    fp_runs, fp = sum(bool(r["decisions"]) for r in runs), sum(len(r["decisions"]) for r in runs)
    iters = sum(r["iters"] for r in runs)
    lines = [
        f"| {label} | {gc.rate(detected, len(harmful))} | {gc.rate(right, diagnosed)} | "
        f"{gc.rate(fp_runs, len(runs))} | {1000 * fp / max(iters, 1):.2f} ({fp} in {iters}) | "
        f"{gc.rate(within, len(harmful))} | mean {sum(rollbacks) / max(len(rollbacks), 1):.2f}, max "
        f"{max(rollbacks, default=0)} |"
    ]
    return lines, rows


def report(out):
    recorded, new = gc.runs_of(FOURTH), gc.runs_of(out)
    harmful = sorted(int(n.split("-")[0]) for n in new if n.endswith("-guarded"))
    cleans = sorted(int(n.split("-")[0]) for n in new if n.endswith("-clean"))
    head = [
        "| guard | harmful faults detected | diagnoses right | clean runs with a decision | false positives per "
        "1,000 clean iterations | final loss within 1% of the clean twin (harmful) | rollbacks per harmful fault |",
        "|---|---|---|---|---|---|---|",
    ]
    before, _ = measures(
        "as registered (the fourth campaign's records: held out)",
        lambda k: recorded[f"{k}-guarded"],
        lambda k: recorded[f"{k}-clean"],
        harmful,
        cleans,
        recorded,
    )
    after, rows = measures(
        "this change (re-run: DESIGN numbers)",
        lambda k: new[f"{k}-guarded"],
        lambda k: new[f"{k}-clean"],
        harmful,
        cleans,
        recorded,
    )
    text = (
        "\n".join(
            head
            + before
            + after
            + [
                "",
                "This change, per harmful trial:",
                "",
                "| fault | decided | unguarded / clean | guarded / clean | exit | rollbacks |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )
    fps = [
        f"- trial {k}'s clean twin: {re.sub(r'; .*', '', new[f'{k}-clean']['decisions'][0])}"
        for k in cleans
        if new[f"{k}-clean"]["decisions"]
    ]
    return text + (
        "\nClean twins with a decision under this change:\n\n" + "\n".join(fps) + "\n"
        if fps
        else ""
    )


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        print(report(sys.argv[2]), end="")
    else:
        rerun(
            sys.argv[1],
            sys.argv[2],
            [(int(j.split(":")[0]), j.split(":")[1]) for j in sys.argv[3:]],
        )
