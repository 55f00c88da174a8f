"""stablegpt's CPU training speed against nanoGPT's model on the same shape, and checkouts against each other.

    python tools/cpu_vs_nanogpt.py                                   # this checkout against nanoGPT
    git worktree add /tmp/before 3ee827b
    python tools/cpu_vs_nanogpt.py --trees /tmp/before . --rounds 5  # before/after, and both against nanoGPT

Each measurement is a process of its own (nothing compiled, allocated or cached is shared), and the contenders
take turns, round by round (A B N A B N ...), so that what the machine does meanwhile falls on all of them: run
it on a quiet machine, and read the ratios of each round rather than the absolute numbers. A checkout is timed
by its own bench.py (training.train_step as train.py runs it: fp32, the fused output layer and loss, the
GradBuffer, the clip and AdamW over the fp32 weights); nanoGPT by `--nanogpt` below. The shape is issue 39's
(6 layers x 384, 6 heads, sequence 256, batch 8, GPT-2's vocabulary padded to 50304, fp32, 2 threads).

The nanoGPT side is a minimal restatement of karpathy/nanoGPT's model.py and of its train.py's step (commit
3adf61e of github.com/karpathy/nanoGPT), kept to what costs time: pre-LayerNorm blocks with biases, one
(h x 3h) QKV projection, SDPA with is_causal, the 4h GELU MLP, tied embedding and output layer, cross-entropy on
the whole (tokens x vocabulary) logits, no dropout; then clip_grad_norm_(1.0) and torch.optim.AdamW (weight decay
on the matrices only, as its configure_optimizers; not fused: nanoGPT fuses on CUDA alone). Biases in the linears
and LayerNorms, as GPT-2 and our blocks have them (its GPTConfig's default; its train.py's is bias=False:
--no-nanogpt_bias). Random tokens: the data does not change the work.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

SHAPE = {
    "num_layers": 6,
    "num_attention_heads": 6,
    "hidden_size": 384,
    "seq_length": 256,
    "micro_batch_size": 8,
}
VOCAB = 50304


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trees",
        nargs="*",
        default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
        help="stablegpt checkouts to time (default: this one)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-nanogpt", dest="nanogpt_too", action="store_false", help="checkouts only"
    )
    parser.add_argument(
        "--nanogpt_bias",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="biases in nanoGPT's linears and LayerNorms (GPT-2's, as ours)",
    )
    # one nanoGPT measurement
    parser.add_argument("--nanogpt", action="store_true", help=argparse.SUPPRESS)
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = parser.parse_args(argv)
    # all up front: a bad one otherwise fails after the first measurements (minutes), or at the
    # statistics of none
    for key in ("rounds", "steps", "threads", *SHAPE):
        if getattr(args, key) < 1:
            parser.error(f"--{key} {getattr(args, key)} must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be 0 or more")
    if not args.trees and not args.nanogpt_too:
        parser.error("--trees names no checkout and --no-nanogpt drops nanoGPT: nothing to time")
    for tree in args.trees:
        if not os.path.isfile(os.path.join(tree, "bench.py")):
            parser.error(
                f"--trees {tree} has no bench.py: give the root of a stablegpt checkout "
                "(git worktree add DIR COMMIT makes one)"
            )
    return args


# -----------------------------------------------------------------------------
# nanoGPT's model and step (see the docstring)


def nanogpt_model(args):
    """nanoGPT's GPT at args' shape (see the docstring): model(idx, targets) -> the mean cross-entropy."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, heads, T, B = (
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        args.micro_batch_size,
    )
    bias = args.nanogpt_bias

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h, bias=bias), nn.LayerNorm(h, bias=bias)
            self.c_attn, self.attn_proj = nn.Linear(h, 3 * h, bias=bias), nn.Linear(h, h, bias=bias)
            self.c_fc, self.mlp_proj = (
                nn.Linear(h, 4 * h, bias=bias),
                nn.Linear(4 * h, h, bias=bias),
            )

        def attention(self, x):
            q, k, v = self.c_attn(x).split(h, dim=2)
            # (B, heads, T, d)
            q, k, v = (t.view(B, T, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, h))

        def forward(self, x):
            x = x + self.attention(self.ln_1(x))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, h), nn.Embedding(T, h)
            self.h = nn.ModuleList(Block() for _ in range(args.num_layers))
            self.ln_f = nn.LayerNorm(h, bias=bias)
            self.lm_head = nn.Linear(h, VOCAB, bias=False)
            self.wte.weight = self.lm_head.weight  # tied
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))  # (B, T, vocabulary)
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return GPT()


def nanogpt_tokens_per_second(args):
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nanogpt_model(args)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))
    B, T, times = args.micro_batch_size, args.seq_length, []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, VOCAB, (B, T))
        t0 = time.perf_counter()
        model(x, torch.roll(x, -1, dims=1)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return B * T / statistics.mean(times)


# -----------------------------------------------------------------------------
# The interleaved rounds


def measure(contender, args):
    """tokens/s of one measurement, in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    shape = [f"--{key}={getattr(args, key)}" for key in SHAPE]
    if contender == "nanoGPT":
        command, cwd = (
            [
                sys.executable,
                os.path.abspath(__file__),
                "--nanogpt",
                f"--steps={args.steps}",
                f"--warmup={args.warmup}",
                f"--threads={args.threads}",
                *shape,
                "--nanogpt_bias" if args.nanogpt_bias else "--no-nanogpt_bias",
            ],
            None,
        )
    else:
        command, cwd = (
            [
                sys.executable,
                "bench.py",
                "config/tiny.py",
                *shape,
                f"--global_batch_size={args.micro_batch_size}",
                f"--bench_steps={args.steps}",
                f"--bench_warmup={args.warmup}",
            ],
            contender,
        )
        if "step_costs" in open(os.path.join(contender, "bench.py")).read():
            # the profiled iteration is not timed, but it costs a minute
            command.append("--no-step_costs")
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("tokens/s:")), None)
    if out.returncode or line is None:
        raise SystemExit(
            f"{contender}: no tokens/s line (exit {out.returncode})\n{out.stdout[-2000:]}"
            f"{out.stderr[-2000:]}"
        )
    return float(line.split()[1].replace(",", ""))


def main(argv=None):
    args = parse(argv)
    if args.nanogpt:
        print(f"tokens/s: {nanogpt_tokens_per_second(args):.1f}")
        return
    trees = [os.path.abspath(t) for t in args.trees]
    contenders = trees + (["nanoGPT"] if args.nanogpt_too else [])
    results = {c: [] for c in contenders}
    for r in range(args.rounds):
        for c in contenders:
            results[c].append(measure(c, args))
        print(
            f"round {r + 1}: " + ", ".join(f"{name(c)} {results[c][-1]:,.0f}" for c in contenders),
            flush=True,
        )
    print(
        f"\ntokens/s over {args.rounds} rounds of {args.steps} iterations ({args.threads} threads):"
    )
    for c in contenders:
        ratios = [a / n for a, n in zip(results[c], results.get("nanoGPT", []))]
        against = (
            f", {min(ratios):.3f}-{max(ratios):.3f}x nanoGPT's in the same rounds"
            if ratios and c != "nanoGPT"
            else ""
        )
        print(
            f"  {name(c):40} median {statistics.median(results[c]):8,.1f}  "
            f"({min(results[c]):,.1f}-{max(results[c]):,.1f}){against}"
        )
    if len(trees) == 2:
        ratios = [b / a for a, b in zip(results[trees[0]], results[trees[1]])]
        print(
            f"  {name(trees[1])} / {name(trees[0])}: {min(ratios):.3f}-{max(ratios):.3f} per round"
        )


def name(contender):
    if contender == "nanoGPT":
        return contender
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=contender, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=contender,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{contender} ({commit.stdout.strip() or '?'}{'+changes' if dirty else ''})"


if __name__ == "__main__":
    main()
