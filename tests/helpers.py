"""Shared helpers: a small model on the bundled corpus, run through the real command line."""
import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small model on the bundled corpus; dropout on, so that resuming must restore the RNG too.
SMALL = ["--num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--seq_length=64",
         "--micro_batch_size=4", "--global_batch_size=8", "--log_interval=1", "--eval_interval=1000",
         "--eval_iters=2", "--sample_tokens=0", "--lr_warmup_samples=40", "--lr_decay_samples=800",
         "--hidden_dropout=0.1", "--attention_dropout=0.1",
         # no checkpoints unless a test asks (--save=DIR): tiny's out/tiny would be resumed by the next test
         "--save=none", "--save_interval=none"]

LOG = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)


def run_cli(*args, expect_ok=True):
    """python train.py ARGS in a subprocess (the real command line, exit codes and stderr included)."""
    env = dict(os.environ, WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"train.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_main(*args):
    """train.main(ARGS) in this process (the same code path, without interpreter start-up); returns stdout."""
    import train
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            train.main(list(args))
    finally:
        os.chdir(cwd)
    return out.getvalue()


def log_fields(stdout):
    """{iteration: {field: value string}} of the Megatron log lines (skipped iterations have no fields)."""
    out = {}
    for m in LOG.finditer(stdout):
        fields = {}
        for part in m.group(2).split("|"):
            key, sep, value = part.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        out[int(m.group(1))] = fields
    return out


def losses(stdout):
    return {i: f["lm loss"] for i, f in log_fields(stdout).items() if "lm loss" in f}


@pytest.fixture(scope="session")
def corpus():
    import data
    return data.default_corpus(os.path.join(ROOT, "data"))
