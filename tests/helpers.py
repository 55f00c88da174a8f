"""Shared helpers: a small model on the bundled corpus, run through the real command line; gloo processes; a
checkpoint of any layout written from one process."""
import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import traceback

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


# -----------------------------------------------------------------------------
# Several processes (torch.multiprocessing, gloo)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, tp, pp, fn, args, errors):
    import torch
    import torch.distributed as dist
    import parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        parallel.init(tp, pp, backend="gloo")
        fn(*args)
    except Exception:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        parallel.grid = parallel.Grid()


def spawn(fn, world, tp=1, pp=1, *args):
    """Run fn(*args) on `world` gloo processes laid out as TP x PP x DP; fail with the first rank's traceback."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world, free_port(), tp, pp, fn, args, errors), nprocs=world,
                           start_method="spawn")
    except Exception as e:
        message = errors.get() if not errors.empty() else str(e)
        pytest.fail(message, pytrace=False)


# -----------------------------------------------------------------------------
# A checkpoint of any layout, written from one process


def write_checkpoint(directory, argv, fill, iteration=1):
    """Write DIRECTORY/global_stepITERATION as the ranks of the layout in argv (config keys as on the command
    line; DP=1) would: each rank's stage is built on a grid on paper and fill(stage) sets its weights (e.g.
    hf.load_into). Files, manifest and `latest` as checkpoint.save writes them. Returns the tag directory."""
    import arguments
    import checkpoint
    import parallel
    from model import GPT, GPTConfig
    cfg = arguments.load_config(argv)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    run = {"state": {"iteration": iteration}, "config": arguments.to_dict(cfg)}
    tag_dir = os.path.join(directory, f"global_step{iteration}")
    os.makedirs(tag_dir)
    entries = []
    for rank in range(tp * pp):
        g = parallel.Grid(tp, pp, world_size=tp * pp, rank=rank)
        layers = parallel.partition_layers(cfg.num_layers, pp, cfg.pp_partition_method)[g.pp_rank]
        stage = GPT(GPTConfig.from_config(cfg), layers, g.is_first_stage, g.is_last_stage, grid=g)
        fill(stage)
        entries.append(checkpoint.write_files(tag_dir, stage.state_dict(), run, {"optimizer": {}, "rng": None},
                                              write_model_state=True, g=g))
    checkpoint.write_manifest(tag_dir, entries, g)
    with open(os.path.join(directory, checkpoint.LATEST), "w") as f:
        f.write(f"global_step{iteration}\n")
    return tag_dir
