"""A randomized campaign against the spike guard: faults nobody chose, drawn at random, and the numbers of what the
guard did with them (docs/spike_guard.md, "The campaign").

    python lab/guard_campaign.py --out runs/campaign --data_path DATA --minutes 45
    python lab/guard_campaign.py --out runs/campaign --report      # the table and figure from what has run

Each trial draws a fault family (FAMILIES), its start, length and magnitude, and a seed, and runs three processes
of the tests' 2x64 model with the project's guard flags (GUARD, as tests/test_spike_guard.py): the fault with the
guard, the fault without it, and the clean twin (same seed and precision, guarded: any decision it takes is a false
positive). A fault is harmful when it raises the clean twin's final validation loss by more than 1% unguarded (or
the unguarded run dies). The report gives the detection rate of harmful faults, the diagnosis confusion matrix
(true cause x decided cause), false positives per 1,000 clean iterations, rollbacks per fault and the final
validation losses, each rate with its 95% Wilson interval.

Resumable: each finished run is a line of OUT/runs.jsonl, and a restarted campaign runs only what is missing
(trial k's draw depends on --seed and k alone). One process per run, --jobs at a time; --minutes bounds the wall
time (no trial starts after it). Not a test: it measures, and docs quote what it measured.
"""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--seq_length=64", "--vocab_size=512",
         "--micro_batch_size=8", "--global_batch_size=8", "--lr=2e-3", "--lr_warmup_samples=40",
         "--hidden_dropout=0", "--attention_dropout=0", "--log_interval=1", "--eval_interval=100000",
         "--eval_iters=8", "--sample_tokens=0", "--save=none", "--save_interval=none"]
GUARD = ["--spike_guard", "--spike_guard_window=20", "--spike_guard_min_steps=10", "--spike_guard_rewind=3",
         "--spike_guard_skip_after=2", "--spike_guard_snapshot_interval=5"]
# family -> the cause a right diagnosis names
FAMILIES = {"lr transient": "optimizer", "lr persistent": "optimizer", "random tokens": "data",
            "repeated token": "data", "repeated 8-gram": "data", "poisoned minority": "data",
            "grad bit flip": "hardware", "weight bit flip": "hardware", "numerical bf16": "numerical",
            "numerical fp16": "numerical"}
CAUSES = ["data", "optimizer", "hardware", "numerical", "persistent", "none"]


def draw(seed, k, iters):
    """Trial k: (family, fault flags, precision flags, seed, description), from (seed, k) alone."""
    rng = random.Random(seed * 100_003 + k)
    family = rng.choice(sorted(FAMILIES))
    start = rng.randint(15, iters - 20)
    precision = []
    if family == "lr transient":
        length, factor = rng.randint(1, 6), round(math.exp(rng.uniform(math.log(30), math.log(3000))))
        flags = [f"--inject_lr_iters={start}-{start + length - 1}", f"--inject_lr_factor={factor}"]
        what = f"LR x{factor} for {length}"
    elif family == "lr persistent":  # a resume with a much higher LR: from `start` to the end, on every pass
        factor = round(math.exp(rng.uniform(math.log(10), math.log(100))))
        flags = [f"--inject_lr_iters={start}-{iters}", f"--inject_lr_factor={factor}", "--inject_lr_persistent"]
        what = f"LR x{factor} from then on"
    elif family == "random tokens":
        length = rng.randint(1, 4)
        flags, what = [f"--inject_bad_batch_iters={start}-{start + length - 1}"], f"{length} batches"
    elif family in ("repeated token", "repeated 8-gram", "poisoned minority"):
        length = rng.randint(1, 4)
        kind = {"repeated token": "repeat", "repeated 8-gram": "ngram", "poisoned minority": "minority"}[family]
        fraction = rng.choice([0.125, 0.25, 0.375])
        flags = [f"--inject_degenerate_iters={start}-{start + length - 1}", f"--inject_degenerate_kind={kind}",
                 f"--inject_degenerate_fraction={fraction}"]
        what = f"{length} batches" + (f", {fraction:g} of the samples" if kind == "minority" else "")
    elif family in ("grad bit flip", "weight bit flip"):
        bit, element = rng.randint(0, 31), rng.randint(0, 10**6)
        flags = [f"--inject_bitflip_iters={start}-{start}", f"--inject_bitflip_bit={bit}",
                 f"--inject_bitflip_element={element}",
                 f"--inject_bitflip_target={'grad' if family.startswith('grad') else 'weight'}"]
        what = f"bit {bit} of element {element}"
    else:  # numerical, in bf16 or fp16; in fp16 half of them early, while the loss scale searches
        half = family.split()[1]
        if half == "fp16" and rng.random() < 0.5:
            start = rng.randint(2, 14)
        length = rng.choice([1, 2, 5, 10, 21])
        flags, precision = [f"--inject_numerical_iters={start}-{start + length - 1}"], [f"--{half}"]
        what = f"{length} iterations"
    return family, flags, precision, 1234 + k, f"{family} at {start}: {what}", start


def run_one(out, name, args, data_path):
    """One process: train.py ARGS; its record (final validation loss, guard lines, exit code)."""
    log = os.path.join(out, "logs", f"{name}.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "train.py", *args, f"--data_path={data_path}"], cwd=ROOT, env=env,
                               stdout=f, stderr=subprocess.STDOUT)
    text = open(log).read()
    values = re.findall(r"lm loss value: (\S+)", text)
    lines = [x for x in text.splitlines() if x.startswith("spike guard:")]
    return {"name": name, "exit": code, "valid": float(values[-1]) if values else math.nan,
            "decisions": [x for x in lines if is_decision(x)], "rollbacks": sum("rolled back to" in x for x in lines)}


def is_decision(line):
    """A `spike guard:` line that is a decision (not a sample named, a fault injected, a host, a restore)."""
    noise = (": sample ", "injected a bit flip", " is global rank ", ": on rank ", "rolled back to", "the documents")
    return re.match(r"spike guard: iteration \d+: ", line) is not None and not any(n in line for n in noise)


def cause_of(line):
    for key, cause in (("persistent fault", "persistent"), ("hardware/transient", "hardware"),
                       ("numerical: ", "numerical"), ("data-driven", "data"), ("optimizer-driven", "optimizer")):
        if key in line:
            return cause
    return "none"


def wilson(k, n, z=1.96):
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def campaign(a):
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    path = os.path.join(a.out, "runs.jsonl")
    done = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            done[r["name"]] = r
    base = [*MODEL, f"--train_iters={a.iters}", f"--lr_decay_samples={8 * a.iters}"]
    began, lock, slots = time.time(), threading.Lock(), threading.Semaphore(a.jobs)

    def one(name, args, meta):
        try:
            t0 = time.time()
            record = {"iters": a.iters, **run_one(a.out, name, args, a.data_path), **meta,
                      "seconds": round(time.time() - t0, 1)}
            with lock:
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            print(f"campaign: {name} ({meta['what']}): exit {record['exit']}, valid {record['valid']:.4f}, "
                  f"{len(record['decisions'])} decisions, {record['seconds']} s", flush=True)
        finally:
            slots.release()
    threads = []
    for j in range(a.long_clean):  # long clean runs: false positives late in training too, fewer start-ups
        name, n = f"long{j}-clean", a.long_iters
        if name not in done:
            slots.acquire()
            args = [*MODEL, f"--train_iters={n}", f"--lr_decay_samples={8 * n}", f"--seed={9000 + j}", *GUARD]
            threads.append(threading.Thread(target=one, args=(name, args, {"what": f"clean, {n} iterations",
                                                                            "iters": n})))
            threads[-1].start()
    for k in range(a.first, a.first + a.trials):
        if time.time() - began > 60 * a.minutes:
            print(f"campaign: {a.minutes} minutes spent; stopped before trial {k}", flush=True)
            break
        family, flags, precision, seed, what, start = draw(a.seed, k, a.iters)
        runs = {f"{k}-clean": [*base, *precision, f"--seed={seed}", *GUARD],
                f"{k}-unguarded": [*base, *precision, f"--seed={seed}", *flags],
                f"{k}-guarded": [*base, *precision, f"--seed={seed}", *flags, *GUARD]}
        meta = {"trial": k, "family": family, "what": what, "start": start}
        for name, args in runs.items():
            if name not in done:
                slots.acquire()  # --jobs runs at a time, each one process
                threads.append(threading.Thread(target=one, args=(name, args, meta)))
                threads[-1].start()
    for t in threads:
        t.join()


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


def report(out):
    """OUT/report.md (the tables) and OUT/campaign.png (the figure); returns the markdown."""
    trials = trials_of(out)
    spent = sum(r.get("seconds", 0) for r in runs_of(out).values()) / 3600
    lines = [f"{len(trials)} complete trials (3 runs each; false positives: every finished clean run); "
             f"{spent:.1f} hours of run time (wall, one process each)", ""]
    harmful, detected, right, diagnosed, within, rollbacks = 0, 0, 0, 0, 0, []
    matrix = {t: {c: 0 for c in CAUSES} for t in sorted(set(FAMILIES.values()))}
    cleans = [r for name, r in runs_of(out).items() if name.endswith("-clean")]  # finished, their trial or not
    clean_iters, false_positives, rows = sum(r["iters"] for r in cleans), sum(len(r["decisions"]) for r in cleans), []
    for t in trials:
        clean, bad, guarded = t["clean"], t["unguarded"], t["guarded"]
        ratio = bad["valid"] / clean["valid"] if math.isfinite(bad["valid"]) else math.inf
        is_harmful = bad["exit"] != 0 or not ratio <= 1.01
        acts = [d for d in guarded["decisions"] if int(re.match(r"spike guard: iteration (\d+)", d)[1]) >=
                guarded["start"]]
        true = FAMILIES[guarded["family"]]
        decided = cause_of(acts[0]) if acts else "none"
        if acts:
            matrix[true][decided] += 1
            diagnosed += 1
            right += decided == true
        g_ratio = guarded["valid"] / clean["valid"] if math.isfinite(guarded["valid"]) else math.inf
        if is_harmful:
            harmful += 1
            detected += bool(acts)
            within += g_ratio <= 1.01
            rollbacks.append(guarded["rollbacks"])
        rows.append((guarded["family"], guarded["what"], is_harmful, decided, ratio, g_ratio, guarded["exit"],
                     guarded["rollbacks"]))

    def rate(k, n):
        lo, hi = wilson(k, n)
        return f"{k}/{n} = {k / n:.0%} (95% CI {lo:.0%}-{hi:.0%})" if n else "0/0"
    fp_lo, fp_hi = wilson(false_positives, clean_iters)
    fp = 1000 * false_positives / max(clean_iters, 1)
    lines += ["| measure | goal | measured |", "|---|---|---|",
              f"| harmful faults detected | >= 90% | {rate(detected, harmful)} |",
              f"| diagnoses right (of the faults the guard acted on) | >= 85% | {rate(right, diagnosed)} |",
              f"| false positives per 1,000 clean iterations | <= 0.1 | {fp:.2f} ({false_positives} in {clean_iters}; "
              f"95% CI {1000 * fp_lo:.2f}-{1000 * fp_hi:.2f}) |",
              f"| guarded final loss within 1% of the clean twin's (harmful faults) | >= 90% | "
              f"{rate(within, harmful)} |",
              f"| rollbacks per harmful fault | <= 1 | mean {sum(rollbacks) / max(len(rollbacks), 1):.2f}, max "
              f"{max(rollbacks, default=0)} |", "",
              "Diagnosis (rows: the true cause; columns: the cause of the guard's first decision at or after the "
              "fault's start):", "", "| true \\ decided | " + " | ".join(CAUSES) + " |",
              "|---|" + "---|" * len(CAUSES)]
    lines += [f"| {t} | " + " | ".join(str(matrix[t][c]) for c in CAUSES) + " |" for t in matrix]
    lines += ["", "| fault | harmful | decided | unguarded / clean | guarded / clean | exit | rollbacks |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {w} | {'yes' if h else 'no'} | {d} | {r:.3f} | {g:.3f} | {e} | {rb} |"
              for f, w, h, d, r, g, e, rb in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    figure(rows, os.path.join(out, "campaign.png"))
    return text


def figure(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (family, _, harmful, _, ratio, g_ratio, _, _) in enumerate(rows):
        clip = lambda v: min(v, 1.5) if math.isfinite(v) else 1.5  # noqa: E731 (a diverged run drawn at the top)
        ax.plot([k, k], [clip(ratio), clip(g_ratio)], color="0.8", zorder=1)
        ax.scatter([k], [clip(ratio)], marker="x", color="tab:red" if harmful else "0.5", zorder=2)
        ax.scatter([k], [clip(g_ratio)], marker="o", facecolors="none", edgecolors="tab:blue", zorder=3)
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
    p.add_argument("--minutes", type=float, default=45.0, help="wall-time budget: no trial starts after it")
    p.add_argument("--first", type=int, default=0, help="the first trial's number (a second campaign beside one)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each one process)")
    p.add_argument("--long_clean", type=int, default=0, help="clean guarded runs of --long_iters iterations, first")
    p.add_argument("--long_iters", type=int, default=3000)
    p.add_argument("--report", action="store_true", help="only write the report of what has run")
    a = p.parse_args(argv)
    if not a.report:
        if not a.data_path:
            raise ValueError("--data_path is needed to run trials (a corpus with ids < 512; --report needs none)")
        campaign(a)
    print(report(a.out))


if __name__ == "__main__":
    main()
