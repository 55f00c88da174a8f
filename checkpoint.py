"""Atomic, per-rank checkpoints that resume bit-exactly.

    save/global_step300/mp_rank_00_000_model_states.pt      model shard of (TP rank 0, PP stage 0), + run state
    save/global_step300/rank_00003_optim_states.pt           per global rank: optimizer (shard), RNG states
    save/latest                                              "global_step300"

Every rank writes into global_stepN.partial/; only when all ranks are done does rank 0 rename the directory and
then replace `latest`, each step fsynced. A crash at any point leaves `latest` naming a complete checkpoint.
SLURM's 20-hour limit made every resume a real one (lesson 17), so everything a run depends on is saved: model,
optimizer with its step counter, LR-schedule and loss-scale state, iteration, consumed samples and tokens, the
RNG states of python, numpy, torch and cuda and the dropout streams of rng.py, and the config.
"""
import contextlib
import errno
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

import parallel
import rng

LATEST = "latest"


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(obj_or_text, path):
    tmp = path + ".tmp"
    if isinstance(obj_or_text, str):
        with open(tmp, "w") as f:
            f.write(obj_or_text + "\n")
            f.flush()
            os.fsync(f.fileno())
    else:
        with open(tmp, "wb") as f:
            torch.save(obj_or_text, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def model_file(tag_dir, g=None):
    g = g or parallel.grid
    return os.path.join(tag_dir, f"mp_rank_{g.tp_rank:02d}_{g.pp_rank:03d}_model_states.pt")


def rank_file(tag_dir, g=None):
    g = g or parallel.grid
    return os.path.join(tag_dir, f"rank_{g.rank:05d}_optim_states.pt")


def rng_state():
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "model_parallel": rng.get_states(),  # the dropout stream of TP-split activations (rng.py)
    }


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("model_parallel") is not None:
        rng.set_states(state["model_parallel"])


def topology(g=None):
    g = g or parallel.grid
    return {"tensor_model_parallel_size": g.tp_size, "pipeline_model_parallel_size": g.pp_size,
            "data_parallel_size": g.dp_size}


def _phase(work):
    """work() on this rank, then a barrier that shares failures: (errno, message) of the first rank whose work
    raised an OSError (disk full, permissions), the same on every rank; None when all succeeded."""
    failure = None
    try:
        work()
    except OSError as e:
        failure = (e.errno, f"{e.strerror or e} ({e.filename})" if e.filename else str(e))
    if not dist.is_initialized():
        return failure
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f is not None), None)


def save(save_dir, iteration, model_state, run_state, rank_state, write_model_state):
    """Write one checkpoint from every rank. model_state: this (TP, PP) shard (written by one DP rank,
    write_model_state); run_state: iteration, counters, config, schedules; rank_state: optimizer and RNG.
    A failure on any rank (a full disk) removes the partial directory and raises ValueError on every rank."""
    tag = f"global_step{iteration}"
    final, partial = os.path.join(save_dir, tag), os.path.join(save_dir, tag + ".partial")
    rank0 = parallel.grid.rank == 0

    def prepare():
        if rank0:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # debris of a crash during an earlier save
            os.makedirs(partial)

    def write():
        if write_model_state:
            _atomic_write({"model": model_state, "run": run_state, "topology": topology()}, model_file(partial))
        _atomic_write(rank_state, rank_file(partial))

    def publish():
        if rank0:
            _fsync_dir(partial)
            if os.path.exists(final):  # saving the same iteration again (e.g. after a rollback): replace it
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(save_dir)
            _atomic_write(tag, os.path.join(save_dir, LATEST))
            _fsync_dir(save_dir)

    for work in (prepare, write, publish):
        failure = _phase(work)
        if failure is not None:
            if rank0:
                shutil.rmtree(partial, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(save_dir, LATEST + ".tmp"))
            code, message = failure
            problem = "no space left on device" if code == errno.ENOSPC else message
            raise ValueError(f"saving checkpoint {final} failed: {problem}. The partial checkpoint was removed and "
                             f"{os.path.join(save_dir, LATEST)} still names the previous one; free space (or fix the "
                             "directory) and resume")
    return final


def latest_dir(load_dir):
    """The directory `latest` names, or None when load_dir holds no checkpoint yet."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        if os.path.isdir(load_dir) and any(n.startswith("global_step") for n in os.listdir(load_dir)):
            raise ValueError(f"{load_dir} has global_step* directories but no '{LATEST}' file; write the tag of "
                             f"the checkpoint to resume from into {path} (e.g. echo global_step300 > {path})")
        return None
    with open(path) as f:
        tag = f.read().strip()
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise ValueError(f"{path} names {tag!r} but {tag_dir} does not exist; point '{LATEST}' at an existing "
                         "global_step* directory")
    return tag_dir


def read(path, what, mmap=False):
    """torch.load of a checkpoint file (memory-mapped with mmap=True: only the bytes used are read), or one
    ValueError naming the missing or corrupt file."""
    if not os.path.exists(path):
        raise ValueError(f"checkpoint file {path} ({what}) is missing; the checkpoint is incomplete or was written "
                         "by another topology -- resume from another global_step* by editing 'latest'")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # truncated or corrupt file: say which
        raise ValueError(f"checkpoint file {path} ({what}) cannot be read ({type(e).__name__}: {e}); it is "
                         "corrupt -- resume from another global_step* by editing 'latest'") from None


def load(tag_dir):
    """This rank's (model_state, run_state, rank_state) from a checkpoint directory, after checking that the
    checkpoint was written by the same TP/PP/DP topology."""
    model_blob = read(model_file(tag_dir), "model shard")
    saved, now = model_blob["topology"], topology()
    if saved != now:
        diff = ", ".join(f"{k} {saved[k]} (checkpoint) vs {now[k]} (now)" for k in now if saved[k] != now[k])
        raise ValueError(f"checkpoint {tag_dir} was saved with another parallel layout: {diff}; load it with "
                         "reshard.load")
    return model_blob["model"], model_blob["run"], read(rank_file(tag_dir), "optimizer and RNG state")


def saved_topology(tag_dir):
    """The TP/PP/DP sizes a checkpoint was written with (from TP rank 0, stage 0's file, which every layout has)."""
    first = parallel.Grid(world_size=1)
    return read(model_file(tag_dir, first), "model shard", mmap=True)["topology"]


# -----------------------------------------------------------------------------
# Weight dumps around save and load: how the 176B team found the tied embedding's lost copy and its LayerNorm
# reset on reload (lesson 11). tools/compare_weight_dumps.py diffs them.


def dump_weights(directory, preamble, iteration, model):
    """Write this rank's parameters, exactly as they are, to directory/weight_dumps/debug-...-{preamble}.pt."""
    g = parallel.grid
    out = os.path.join(directory, "weight_dumps")
    os.makedirs(out, exist_ok=True)
    name = f"debug-{iteration}-pp{g.pp_rank}-tp{g.tp_rank}-dp{g.dp_rank}-global{g.rank}-{preamble}.pt"
    weights = {n: p.detach().cpu().clone() for n, p in parallel.unwrap(model).named_parameters()}
    torch.save(weights, os.path.join(out, name))
