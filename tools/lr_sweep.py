"""LR sensitivity of the stability levers on one machine (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities"; docs/stability.md has the study and its numbers).

    python tools/lr_sweep.py --quick                 # 12 runs: 2 lever sets x 3 LRs x 2 seeds, ~5 min on 2 cores
    python tools/lr_sweep.py                         # the study: 9 lever sets x 6 LRs x 3 seeds, ~55 min
    python tools/lr_sweep.py --lever_sets default,qk_layernorm --lrs 1e-3,1e-2,1e-1 --seeds 1,2,3 --jobs 4

A grid of lever sets x learning rates x seeds of one small GPT on the bundled corpus with a fixed token budget.
Each run is train.py in a process of its own (`lr_sweep.py --train ARGS`: train.main with denormals flushed, one
thread each, --jobs at a time) in its own directory,
OUT/runs/<lever set>/lr<lr>-seed<seed>/: its stdout.log, the metrics.jsonl and TensorBoard events train.py
writes beside its checkpoint, and result.json, written last: a run whose directory holds result.json is
finished and skipped by the next call, so an interrupted sweep continues where it stopped. After training, a
probe loads the final checkpoint and measures what the instabilities grow (the largest attention logit of
each layer, the output log Z) on the validation batches, then the checkpoint is deleted (40 MB a run).

From all finished runs of the grid it writes OUT/results.jsonl (one line per run), OUT/results.md (tables) and
OUT/lr_sweep.png (final validation loss against LR, one curve per lever set, the seeds' spread shaded: their
figure 1; beside it the peak training loss), and each lever set's LR sensitivity as they define it: the mean over
the LR grid of min(L(lr), L0) - L*, with L0 the loss at initialisation (ln of the vocabulary: every init here
starts there), L* the lever set's best final loss over the grid, and a diverged run (NaN/inf, or above L0) counted
as L0.
The tables also count the runs that blew up on the way (a logged training loss above L0) even where the decayed
LR let them recover by the end: the final loss alone hides those.
"""
import argparse
import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The model and schedule every run shares: GPT-2's defaults (init 0.02, beta2 0.999, fp32, no embedding LayerNorm)
# set explicitly, since the default config (config/tiny.py) turns some levers on. 2 layers of 64, 512 tokens an
# iteration, 120 iterations (61,440 tokens), 10 of warm-up, cosine to lr/10: about 30 s of one core a run.
# Micro-batches of 2: their logits (2 x 64 x 50304 fp32, 26 MB) fit under glibc's largest mmap threshold (32 MB,
# which execute() sets), so the allocator reuses their memory instead of page-faulting fresh memory for each one:
# 225 ms an iteration against 311 ms for the batch of 8 at once, with the same numbers up to summation order.
# 16 validation batches (8,192 tokens): fewer made the seeds' spread mostly the validation sample's.
BASE = ["--num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--seq_length=64", "--micro_batch_size=2",
        "--global_batch_size=8", "--train_iters=none", "--train_tokens=61440", "--lr_warmup_samples=80",
        "--lr_decay_samples=960", "--lr_decay_style=cosine", "--hidden_dropout=0", "--attention_dropout=0",
        "--init_method_std=0.02", "--embed_layernorm=false", "--adam_beta2=0.999", "--weight_decay=0.01",
        "--clip_grad=1.0", "--log_interval=10", "--eval_interval=1000000", "--eval_iters=16", "--sample_tokens=0",
        "--save_interval=none", "--telemetry_interval=10"]
VOCAB_SIZE = 50257  # GPT-2's, the bundled corpus's tokenizer

# Each lever set against the defaults above; the lessons of docs/lessons.md they come from.
LEVER_SETS = {
    "default": [],  # GPT-2: init 0.02, fp32, beta2 0.999
    "small_init": ["--init_method_std=small_init"],  # lesson 3
    "embed_layernorm": ["--embed_layernorm"],  # lesson 1
    "small_init+embed_layernorm": ["--init_method_std=small_init", "--embed_layernorm"],  # lessons 1-3
    "stable_attention": ["--stable_attention"],  # lesson 4
    "qk_layernorm": ["--qk_layernorm"],  # lesson 20
    "z_loss": ["--z_loss=1e-4"],  # lesson 20, PaLM's coefficient
    "adam_beta2_0.95": ["--adam_beta2=0.95"],  # lesson 4 (lower beta2 did not cure the 104B's spikes)
    "bf16": ["--bf16"],  # lesson 6
}
# From well below the default's best LR (1e-2) to where it blows up (1): 2.5 orders of magnitude.
FULL = {"lever_sets": list(LEVER_SETS), "lrs": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0], "seeds": [1, 2, 3]}
QUICK = {"lever_sets": ["default", "qk_layernorm"], "lrs": [1e-2, 1e-1, 1.0], "seeds": [1, 2]}


# -----------------------------------------------------------------------------
# One run


def run_dir(out, lever_set, lr, seed):
    return os.path.join(out, "runs", lever_set, f"lr{lr:.0e}-seed{seed}")


def train_args(lever_set, lr, seed, directory, extra=()):
    return [*BASE, *LEVER_SETS[lever_set], f"--lr={lr}", f"--min_lr={lr / 10}", f"--seed={seed}",
            f"--save={directory}", *extra]


def parse_log(text):
    """What a run's Megatron log says: {"val_loss": last validation loss, "train_loss": last logged lm loss,
    "train_loss_max", "grad_norm_max", "z_loss_max": the largest logged, "nan_iterations": count}."""
    out = {"val_loss": None, "train_loss": None, "train_loss_max": None, "grad_norm_max": None, "z_loss_max": None,
           "nan_iterations": 0}
    for line in text.splitlines():
        if "validation loss at iteration" in line and "lm loss value:" in line:
            out["val_loss"] = float(line.split("lm loss value:")[1].split("|")[0])
        elif line.startswith(" iteration") and "lm loss:" in line:
            fields = dict(part.split(":", 1) for part in line.split("|") if ":" in part)
            fields = {k.strip(): v.strip() for k, v in fields.items()}
            out["train_loss"] = float(fields["lm loss"])
            out["nan_iterations"] += int(fields.get("number of nan iterations", 0))
            for key, name in (("lm loss", "train_loss_max"), ("grad norm", "grad_norm_max"), ("z loss", "z_loss_max")):
                if key in fields:
                    value = float(fields[key])
                    out[name] = value if out[name] is None or not value <= out[name] else out[name]
    return out


def read_metrics(path):
    """The same numbers from metrics.jsonl (the spike-guard issue's file), where the run wrote one: the last
    record of each iteration counts; telemetry adds the largest attention logit, log Z, word-embedding norm and
    block-output RMS seen in training, and each layer's largest grad norm (embedding, blocks, final LayerNorm)."""
    records = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                records[record["iteration"]] = {**records.get(record["iteration"], {}), **record}
    out = {}
    for _, record in sorted(records.items()):
        if "validation lm loss" in record:
            out["val_loss"] = record["validation lm loss"]
        telemetry = record.get("telemetry") or {}
        for key, name in (("attention logit max", "train_attention_logit_max"), ("log z max", "train_log_z_max"),
                          ("word embedding norm", "train_embedding_norm_max"),
                          ("block output rms", "train_block_output_rms_max")):
            value = telemetry.get(key)
            value = max(value) if isinstance(value, list) else value
            if value is not None:
                out[name] = value if name not in out or not value <= out[name] else out[name]
        if "grad norm" in telemetry:
            old = out.get("train_grad_norm_layer_max", telemetry["grad norm"])
            out["train_grad_norm_layer_max"] = [a if not b > a else b for a, b in zip(old, telemetry["grad norm"])]
    return out


def probe(directory):
    """Load the run's final checkpoint and measure, on its validation batches: the largest pre-softmax attention
    logit q.k/sqrt(d) of each layer (as attention sees q and k: after qk-layernorm, whatever the scaling
    variant) and the mean and largest log Z of the output softmax. Returns a dict."""
    import numpy as np
    import torch

    import arguments
    import checkpoint
    import model as model_module
    import schedule
    import train
    tag = checkpoint.latest_dir(directory)
    model_state, run, _ = checkpoint.load(tag)
    cfg = arguments.Config(**{k: v for k, v in run["config"].items() if k in arguments.FIELDS})
    cfg = arguments.prepare(cfg)
    gpt = train.build_model(cfg, torch.device("cpu"))
    gpt.load_state_dict(model_state)
    gpt.eval()
    _, valid = train.build_data(cfg, schedule.Schedule(cfg, 1))
    logits_max, original = [], model_module.core_attention

    def recording(q, k, v, *args, **kwargs):
        scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        logits_max.append(scores.masked_fill(~causal, -math.inf).amax().item())
        return original(q, k, v, *args, **kwargs)

    log_z = []
    model_module.core_attention = recording
    try:
        with torch.no_grad():
            for i in range(cfg.eval_iters):
                for first in range(i * cfg.global_batch_size, (i + 1) * cfg.global_batch_size, cfg.micro_batch_size):
                    # the batches train.evaluate reads, a micro-batch at a time
                    tokens = np.stack([valid[first + j] for j in range(cfg.micro_batch_size)]).astype(np.int64)
                    logits = gpt(torch.from_numpy(tokens[:, :-1]))  # in the run's own precision (precision.py)
                    log_z.append(torch.logsumexp(logits.float()[..., :cfg.vocab_size], dim=-1).flatten())
    finally:
        model_module.core_attention = original
    log_z = torch.cat(log_z)
    layers = cfg.num_layers
    per_layer = [max(logits_max[layer::layers]) for layer in range(layers)]
    return {"attention_logit_max": per_layer, "log_z_mean": log_z.mean().item(), "log_z_max": log_z.max().item()}


def run(command, log, env):
    """Run command with its output into the file log; returns (exit code, CPU seconds it used, user + system)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage (other runs go on in parallel)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def execute(out, lever_set, lr, seed, extra=()):
    """Train one run (unless finished), probe it, write result.json last. Returns the result or an error dict."""
    directory = run_dir(out, lever_set, lr, seed)
    result_file = os.path.join(directory, "result.json")
    args = train_args(lever_set, lr, seed, directory, extra)
    if os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        if result.get("args", args) != args:  # the grid was redefined: its old results are not this run's
            raise SystemExit(f"{directory} holds a run with other arguments than this sweep's; use another --out "
                             "or delete it")
        return result
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # an interrupted attempt: start over (metrics.jsonl would append)
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    # glibc hands blocks above its mmap threshold back to the kernel when freed, and trims the heap's free top, so
    # each new logits tensor was page-faulted in afresh (a quarter of a run's time was the kernel's). With the
    # threshold fixed at its 32 MB maximum and trimming out of reach, the 26 MB blocks are reused: the same
    # numbers, 24% faster with two runs side by side.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled",
               MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(4 << 30))
    start = time.time()
    with open(os.path.join(directory, "stdout.log"), "w") as log:
        code, cpu = run([sys.executable, os.path.abspath(__file__), "--train", *args], log, env)
    seconds = time.time() - start
    with open(os.path.join(directory, "stdout.log")) as f:
        text = f.read()
    if code != 0:
        return {"lever_set": lever_set, "lr": lr, "seed": seed, "error": text[-2000:]}
    result = {"lever_set": lever_set, "lr": lr, "seed": seed, "args": args, "seconds": round(seconds, 1),
              "cpu_seconds": round(cpu, 1), **parse_log(text)}
    metrics = os.path.join(directory, "metrics.jsonl")
    if os.path.exists(metrics):
        result.update(read_metrics(metrics))
    probe_log = os.path.join(directory, "probe.log")
    with open(probe_log, "w") as log:
        code, cpu = run([sys.executable, os.path.abspath(__file__), "--probe", directory], log, env)
    with open(probe_log) as f:
        text = f.read()
    if code != 0:
        return {**result, "error": text[-2000:]}
    result.update(json.loads(text.strip().splitlines()[-1]), probe_cpu_seconds=round(cpu, 1))
    for name in os.listdir(directory):  # the checkpoint has served the probe
        if name.startswith("global_step") or name == "latest":
            path = os.path.join(directory, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with open(result_file + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_file + ".tmp", result_file)  # atomically: present means finished
    return result


# -----------------------------------------------------------------------------
# Summaries


def clipped(loss, l0):
    """A final loss as the sensitivity counts it: a diverged run (NaN/inf or above L0) counts as L0."""
    return l0 if loss is None or not math.isfinite(loss) or loss > l0 else loss


def sensitivity(losses, l0):
    """Wortsman et al.'s LR sensitivity of one curve {lr: final loss}: mean over the LR grid of
    min(L(lr), L0) - L*, with L* the curve's best loss (L0 if every run diverged)."""
    values = [clipped(loss, l0) for loss in losses.values()]
    best = min(values)
    return sum(v - best for v in values) / len(values)


def blew_up(result, l0):
    """Whether the run's training loss left the trained regime on the way: a NaN iteration or a logged loss above
    L0 (what every run starts from), even if the decaying LR let it recover by the end."""
    peak = result.get("train_loss_max")
    return bool(result.get("nan_iterations")) or (peak is not None and not peak <= l0)


def summarize(results, lever_sets, lrs, seeds, l0=math.log(VOCAB_SIZE)):
    """Per lever set: the seed-mean curve, its spread, sensitivity (of the mean curve, and the range over
    seeds' own curves), best loss and LR, the largest LR at which no seed's final loss diverged, and the largest
    up to which no seed blew up during training."""
    by_key = {(r["lever_set"], r["lr"], r["seed"]): r for r in results if "error" not in r}
    rows = []
    for lever_set in lever_sets:
        curves = {seed: {lr: clipped(by_key[(lever_set, lr, seed)]["val_loss"], l0) for lr in lrs
                         if (lever_set, lr, seed) in by_key} for seed in seeds}
        curves = {seed: curve for seed, curve in curves.items() if curve}
        if not curves:
            continue
        points = {}
        for lr in lrs:
            runs = [by_key[(lever_set, lr, s)] for s in curves if (lever_set, lr, s) in by_key]
            if runs:
                values = [clipped(r["val_loss"], l0) for r in runs]
                points[lr] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values),
                              "n": len(values), "diverged": sum(v == l0 for v in values),
                              "blew_up": sum(blew_up(r, l0) for r in runs),
                              "peak": _mean([r.get("train_loss_max") for r in runs])}
        mean_curve = {lr: p["mean"] for lr, p in points.items()}
        per_seed = [sensitivity(curve, l0) for curve in curves.values() if len(curve) == len(points)]
        best_lr = min(mean_curve, key=mean_curve.get)
        stable = [lr for lr, p in points.items() if p["diverged"] == 0]
        calm = [lr for lr in sorted(points) if all(points[x]["blew_up"] == 0 for x in points if x <= lr)]
        rows.append({"lever_set": lever_set, "points": points, "sensitivity": sensitivity(mean_curve, l0),
                     "sensitivity_seeds": (min(per_seed), max(per_seed)) if per_seed else None,
                     "best_loss": mean_curve[best_lr], "best_lr": best_lr,
                     "max_stable_lr": max(stable) if stable else None, "max_calm_lr": max(calm) if calm else None,
                     "complete": len(points) == len(lrs)})
    return rows


def markdown(rows, results, lrs, l0):
    lines = [f"L0 = ln({VOCAB_SIZE}) = {l0:.3f}: the loss at initialisation, and a diverged run's.", "",
             "| lever set | LR sensitivity (seeds' range) | best val loss | at LR | largest LR, no seed diverged | "
             "largest LR up to which no seed blew up |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        spread = row["sensitivity_seeds"]
        spread = f" ({spread[0]:.3f}-{spread[1]:.3f})" if spread else ""
        stable, calm = (f"{row[k]:.0e}" if row[k] else "none" for k in ("max_stable_lr", "max_calm_lr"))
        lines.append(f"| {row['lever_set']} | {row['sensitivity']:.3f}{spread} | {row['best_loss']:.3f} | "
                     f"{row['best_lr']:.0e} | {stable} | {calm} |")
    header = ["| lever set | " + " | ".join(f"{lr:.0e}" for lr in lrs) + " |", "| --- |" + " --- |" * len(lrs)]
    lines += ["", "Final validation loss, mean over seeds [min-max]; `div k`: k seeds' final loss diverged (counted as "
              "L0); `up k`: k seeds' training loss rose above L0 on the way:", "", *header]
    for row in rows:
        cells = []
        for lr in lrs:
            p = row["points"].get(lr)
            if p is None:
                cells.append("")
                continue
            cell = f"{p['mean']:.2f} [{p['min']:.2f}-{p['max']:.2f}]" if p["n"] > 1 else f"{p['mean']:.2f}"
            cells.append(cell + (f" div {p['diverged']}" if p["diverged"] else "") +
                         (f" up {p['blew_up']}" if p["blew_up"] else ""))
        lines.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")

    def table(title, keys, where):
        """A table of per-run numbers (mean over seeds) of the runs that have them, cells 'a / b / c'."""
        have = [r for r in results if "error" not in r and all(where(r, k) is not None for k in keys)]
        if not have:
            return []
        out = ["", title, "", *header]
        for row in rows:
            cells = []
            for lr in lrs:
                mine = [r for r in have if r["lever_set"] == row["lever_set"] and r["lr"] == lr]
                cells.append(" / ".join(f"{_mean([where(r, k) for r in mine]):.3g}" for k in keys) if mine else "")
            out.append(f"| {row['lever_set']} | " + " | ".join(cells) + " |")
        return out

    lines += table("During training, the largest value logged (telemetry every 10 iterations), mean over seeds: "
                   "attention logit / output log Z / word-embedding norm:",
                   ["train_attention_logit_max", "train_log_z_max", "train_embedding_norm_max"],
                   lambda r, k: r.get(k))
    lines += table("The final model on the validation batches, mean over seeds: largest attention logit (over "
                   "layers) / mean output log Z:", ["attention_logit_max", "log_z_mean"],
                   lambda r, k: (max(r[k]) if isinstance(r.get(k), list) else r.get(k)))
    return "\n".join(lines) + "\n"


def _mean(values):
    """The mean of the finite values (None, NaN and inf left out); NaN if there are none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def plot(rows, lrs, l0, path):
    """Left, their figure 1: final validation loss against LR, mean over seeds, min-max shaded. Right: the peak of
    the logged training loss, which shows the runs that blew up on the way and recovered by the end."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, peak_ax) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=100)
    styles = ["-", "--", "-.", ":"]
    for i, row in enumerate(rows):
        style = dict(marker="o", markersize=4, linestyle=styles[i // 10 % len(styles)])
        xs = sorted(row["points"])
        mean = [row["points"][lr]["mean"] for lr in xs]
        line, = ax.plot(xs, mean, label=f"{row['lever_set']} (LR sens. {row['sensitivity']:.2f})", **style)
        ax.fill_between(xs, [row["points"][lr]["min"] for lr in xs], [row["points"][lr]["max"] for lr in xs],
                        color=line.get_color(), alpha=0.15, linewidth=0)
        peaks = [lr for lr in xs if math.isfinite(row["points"][lr]["peak"])]
        peak_ax.plot(peaks, [row["points"][lr]["peak"] for lr in peaks], color=line.get_color(), **style)
    for axis in (ax, peak_ax):
        axis.axhline(l0, color="grey", linestyle="--", linewidth=1, label="loss at init, L0")
        axis.set_xscale("log")
        axis.set_xticks(lrs, [f"{lr:.0e}" for lr in lrs])
        axis.set_xlabel("learning rate")
        axis.grid(alpha=0.3)
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title("final loss: mean over seeds, shaded min-max")
    ax.legend(fontsize=7)
    peak_ax.set_yscale("log")
    peak_ax.set_ylabel("largest logged training loss (nats)")
    peak_ax.set_title("on the way: above L0 = blew up")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -----------------------------------------------------------------------------
# Main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 12-run grid: " + json.dumps(QUICK))
    p.add_argument("--out", default=os.path.join(ROOT, "out", "lr_sweep"), help="directory of runs and results")
    p.add_argument("--lever_sets", help="comma-separated, from: " + ", ".join(LEVER_SETS))
    p.add_argument("--lrs", help="comma-separated learning rates")
    p.add_argument("--seeds", help="comma-separated seeds")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="runs at a time, one thread each")
    p.add_argument("--extra", default="", help="more train.py arguments for every run, after an = sign (e.g. "
                   "--extra=--z_loss=1e-2); changes the runs, so use another --out")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: probe one run directory, print JSON
    args = p.parse_args(argv)
    grid = QUICK if args.quick else FULL
    args.lever_sets = args.lever_sets.split(",") if args.lever_sets else grid["lever_sets"]
    args.lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else grid["lrs"]
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else grid["seeds"]
    unknown = [s for s in args.lever_sets if s not in LEVER_SETS]
    if unknown:
        p.error(f"unknown lever set(s) {unknown}; choose from {', '.join(LEVER_SETS)}")
    return args


def train(argv):
    """One run: train.py's main with denormal floats flushed to zero. A run that blows up drives most of its
    softmax's probabilities below fp32's normal range, where x86 arithmetic on denormals is 2-4x slower; flushed,
    they read as the zeros they round to a moment later (a blown-up run, run both ways, ended on the same
    validation loss to 7 digits)."""
    import torch
    torch.set_flush_denormal(True)
    import train as train_module
    train_module.main(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:  # internal: one run of the grid, in its own process
        return train(argv[1:])
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return
    extra = args.extra.split()
    grid = [(s, lr, seed) for s in args.lever_sets for lr in args.lrs for seed in args.seeds]
    todo = [g for g in grid if not os.path.exists(os.path.join(run_dir(args.out, *g), "result.json"))]
    print(f"{len(grid)} runs, {len(grid) - len(todo)} finished already, {len(todo)} to run, {args.jobs} at a time",
          flush=True)
    import data
    data.default_corpus()  # tokenize the bundled corpus once, before the runs race to do it
    results, start = [], time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda g: execute(args.out, *g, extra), grid):
            results.append(result)
            status = "error" if "error" in result else f"val {result['val_loss']:.4f}"
            print(f"[{time.time() - start:6.0f}s] {result['lever_set']} lr {result['lr']:.0e} seed "
                  f"{result['seed']}: {status}", flush=True)
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"failed: {r['lever_set']} lr {r['lr']} seed {r['seed']}:\n{r['error']}", file=sys.stderr)
    l0 = math.log(VOCAB_SIZE)
    rows = summarize(results, args.lever_sets, args.lrs, args.seeds, l0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    table = markdown(rows, results, args.lrs, l0)
    timed = [r for r in results if "cpu_seconds" in r]
    if timed:  # what the grid costs on a free machine: CPU seconds per run, whatever the load was
        cpu = [r["cpu_seconds"] + r.get("probe_cpu_seconds", 0.0) for r in timed]
        table += (f"\nCPU time (train + probe), {len(timed)} runs measured: {sum(cpu) / len(cpu):.0f} s a run, "
                  f"{sum(cpu) / 60:.0f} min in all (wall time on 2 free cores about half that).\n")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    plot(rows, args.lrs, l0, os.path.join(args.out, "lr_sweep.png"))
    print(table)
    print(f"wrote {args.out}/results.jsonl, results.md, lr_sweep.png in {time.time() - start:.0f}s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
