"""Atomic, per-rank checkpoints that resume bit-exactly.

    save/global_step300/mp_rank_00_000_model_states.pt      model shard of (TP rank 0, PP stage 0), + run state
    save/global_step300/rank_00003_optim_states.pt           per global rank: optimizer (shard), RNG states
    save/global_step300/manifest.json                        every file's size and CRC-32, the layout
    save/latest                                              "global_step300"

Every rank writes into global_stepN.partial/ (write_files), computing each file's size and CRC-32 from the bytes
as they are written (no second read); when all ranks are done, rank 0 writes the manifest, renames the directory
and then replaces `latest` (publish), each step fsynced. A crash at any point leaves `latest` naming a complete
checkpoint, or (saving an iteration again, killed between the old copy's rename to global_stepN.replaced and the
new one's into place) refused by latest_dir with the two whole copies named. A file is checked against the
manifest before its tensors are read (read), so a truncated or bit-rotted file is named, with the earlier
checkpoint to resume from, instead of failing somewhere in torch.load or, worse, loading;
tools/check_checkpoint.py checks a whole checkpoint offline.
The run state it holds is checked before a resume uses it (checked_run_state): every key of its
type and in its range, an older version's missing key filled by a named migration, never a default
in silence. A global_stepN.partial is never a checkpoint: a directory holding one and no `latest`
is refused, naming it as a killed save or import.
SLURM's 20-hour limit made every resume a real one (lesson 17), so everything a run depends on is saved: model,
optimizer with its step counter, LR-schedule and loss-scale state, iteration, consumed samples and tokens, the
RNG states of python, numpy, torch and cuda and the dropout streams of rng.py, and the config.
"""

import contextlib
import copy
import errno
import json
import numbers
import os
import random
import re
import shutil
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import files
import parallel
import rng
import schedule

LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# a manifest's topology: the sizes topology() writes
TOPOLOGY_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")


# -----------------------------------------------------------------------------
# Checkpointing's keys and their checks (arguments.Config is made of each owner's keys)


@dataclass
class CheckpointConfig:
    # -- checkpoint --
    # a transformers GPT-2/BLOOM/Llama directory: its config and weights start the run
    init_from_hf: str | None = None
    # checkpoint directory; a run resumes from it when it holds a checkpoint
    save: str | None = None
    # resume from this directory's `latest`; None: from save when it holds one
    load: str | None = None
    save_interval: int | None = None  # save every this many iterations (and always at the end)
    # copy the state to host memory and write it on a background thread while training goes on
    async_save: bool = False
    no_load_optim: bool = False  # resume without the optimizer state (fresh Adam)
    no_load_rng: bool = False  # resume without the RNG states (fresh streams: seed + iteration)
    # save and exit at every multiple of this iteration (Megatron's: the run's iteration, not the job's count)
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None  # save and exit when this job has run this long
    # on SIGTERM or SIGUSR1 (SLURM's --signal): finish the iteration, save, exit 0
    exit_signal_handler: bool = False
    # write every rank's weights around save and load, to diff them (lesson 11)
    dump_weights: bool = False

    # keys read only while a switch is on (sections.py): a run resumes from load, or from save when it holds one
    SWITCHED = {
        "save": ("save_interval", "async_save"),
        "load|save": ("no_load_optim", "no_load_rng", "dump_weights"),
    }


def check(ckpt_cfg, eval_only=False):
    """Raise ValueError with the fix for checkpoint keys that cannot work. eval_only: logging's key (such a run
    writes nothing)."""
    if eval_only and ckpt_cfg.dump_weights:
        raise ValueError(
            "dump_weights writes the loaded weights into the load directory, and eval_only writes nothing: "
            "drop dump_weights (tools/compare_weight_dumps.py reads the dumps of a resumed training run)"
        )
    if ckpt_cfg.save_interval is not None and ckpt_cfg.save_interval <= 0:
        raise ValueError("save_interval must be positive")
    # Megatron reads 0 as off; here a count of 0 would stop after the first iteration
    for key in ("exit_interval", "exit_duration_in_mins"):
        value = getattr(ckpt_cfg, key)
        if value is not None and value <= 0:
            raise ValueError(f"{key}={value} must be positive; unset it for no exit")


class _Checksummed:
    """A binary file that counts and CRC-32s the bytes written through it (torch.save streams into it)."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, b):
        view = memoryview(b)
        self.size += view.nbytes
        self.crc = zlib.crc32(view, self.crc)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def atomic_write(obj_or_text, path):
    """Write a text, or torch.save an object, to path through a fsynced temporary file; returns the file's
    manifest entry {"bytes", "crc32"}."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        out = _Checksummed(f)
        if isinstance(obj_or_text, str):
            out.write((obj_or_text + "\n").encode())
        else:
            torch.save(obj_or_text, out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": out.size, "crc32": f"{out.crc:08x}"}


def point_latest(save_dir, tag):
    """`latest` names tag, once the directory's renames are on disk, through a temporary file: a kill leaves the
    old `latest` or the new one, never an empty or partly written one."""
    files.fsync_dir(save_dir)
    atomic_write(tag, os.path.join(save_dir, LATEST))
    files.fsync_dir(save_dir)


def model_file(tag_dir, g=None):
    g = g or parallel.grid
    return os.path.join(tag_dir, f"mp_rank_{g.tp_rank:02d}_{g.pp_rank:03d}_model_states.pt")


def rank_file(tag_dir, g=None):
    g = g or parallel.grid
    return os.path.join(tag_dir, f"rank_{g.rank:05d}_optim_states.pt")


def layout_files(tag_dir, topology):
    """Every file of a checkpoint written by this layout: the model shard of each (TP rank, stage), then the
    optimizer file of each rank."""
    tp, pp, dp = (
        topology[k]
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "data_parallel_size",
        )
    )
    grids = [parallel.Grid(tp, pp, world_size=tp * pp * dp, rank=r) for r in range(tp * pp * dp)]
    return [model_file(tag_dir, g) for g in grids if g.dp_rank == 0] + [
        rank_file(tag_dir, g) for g in grids
    ]


def rng_state():
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": rng.cuda_state(),  # this rank's GPU only (rng.py)
        "model_parallel": rng.get_states(),  # the dropout stream of TP-split activations (rng.py)
    }


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    rng.set_cuda_state(state["cuda"])
    if state.get("model_parallel") is not None:
        rng.set_states(state["model_parallel"])


def topology(g=None):
    g = g or parallel.grid
    return {
        "tensor_model_parallel_size": g.tp_size,
        "pipeline_model_parallel_size": g.pp_size,
        "data_parallel_size": g.dp_size,
    }


MESSAGE_BYTES = 1024  # of a failed rank's OSError message, shared with every rank


def _phase(work, group=None):
    """work() on this rank, then a barrier (on `group`) that shares failures and results: (failure, [every rank's
    result]), failure being (errno, message) of the first rank whose work raised an OSError (disk full,
    permissions), the same on every rank, or None when all succeeded. A result is None or a list of RESULT_WIDTH
    integers. Shared by all-gathers of int64 and uint8 tensors on the group's device, no object collective: a
    save at save_interval is inside the training loop, on NCCL when it is synchronous."""
    failure = result = None
    try:
        result = work()
    except OSError as e:
        failure = (e.errno, f"{e.strerror or e} ({e.filename})" if e.filename else str(e))
    if not dist.is_initialized():
        return failure, [result]
    code, text = failure or (0, "")
    numbers = _all_gather(
        [failure is not None, code or 0, result is not None, *(result or [0] * RESULT_WIDTH)],
        torch.int64,
        group,
    )
    failed = next((r for r, row in enumerate(numbers) if row[0]), None)
    if failed is not None:  # the first failed rank's message: the same words on every rank
        message = list(text.encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0"))
        text = (
            bytes(_all_gather(message, torch.uint8, group)[failed])
            .rstrip(b"\0")
            .decode(errors="replace")
        )
        failure = (numbers[failed][1] or None, text)
    return failure, [row[3:] if row[2] else None for row in numbers]


def _all_gather(values, dtype, group):
    """Every rank's list of values (as many on each), as lists: one all-gather of a tensor on the device of the
    group's backend (the current GPU under NCCL) and one copy to the host."""
    mine = torch.tensor(values, dtype=dtype, device=parallel.comm_device(dist.get_backend(group)))
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu().tolist()


# A rank's manifest entries as RESULT_WIDTH integers: bytes and CRC-32 of its model file (-1: none), of its rank file
RESULT_WIDTH = 4


def _entry_numbers(entries, g):
    model = entries.get(os.path.basename(model_file("", g)), {"bytes": -1, "crc32": "0"})
    rank = entries[os.path.basename(rank_file("", g))]
    return [model["bytes"], int(model["crc32"], 16), rank["bytes"], int(rank["crc32"], 16)]


def _entries(numbers, g):
    model_bytes, model_crc, rank_bytes, rank_crc = numbers
    entries = {
        os.path.basename(rank_file("", g)): {"bytes": rank_bytes, "crc32": f"{rank_crc:08x}"}
    }
    if model_bytes >= 0:
        entries[os.path.basename(model_file("", g))] = {
            "bytes": model_bytes,
            "crc32": f"{model_crc:08x}",
        }
    return entries


def write_files(tag_dir, model_state, run_state, rank_state, write_model_state, g=None):
    """Write one rank's files into tag_dir; returns their manifest entries {file name: {"bytes", "crc32"}}.
    model_state: this (TP, PP) shard (written by one DP rank, write_model_state); run_state: iteration, counters,
    config, schedules; rank_state: optimizer and RNG. g: the rank (default: this process's)."""
    g = g or parallel.grid
    entries = {}
    if write_model_state:
        path = model_file(tag_dir, g)
        entries[os.path.basename(path)] = atomic_write(
            {"model": model_state, "run": run_state, "topology": topology(g)}, path
        )
    path = rank_file(tag_dir, g)
    entries[os.path.basename(path)] = atomic_write(rank_state, path)
    return entries


def write_manifest(tag_dir, entries, g=None):
    """tag_dir/manifest.json from every rank's write_files entries, merged (fsynced, before `latest` moves)."""
    files = {}
    for e in entries:
        files.update(e)
    manifest = {
        "format": MANIFEST_FORMAT,
        "checksum": "crc32",
        "topology": topology(g),
        "files": dict(sorted(files.items())),
    }
    atomic_write(json.dumps(manifest, indent=1), os.path.join(tag_dir, MANIFEST))


def _replace(partial, final):
    """Move a whole checkpoint into place and point `latest` at it. Saving an iteration again (a rollback, a
    resume from an earlier `latest`) sets the old copy aside by a rename and deletes it only once the new one is
    in place and named: no moment has `latest` on a deleted or half-deleted directory (latest_dir names the two
    renames' gap, save() puts the old copy back on a failure there)."""
    save_dir, tag = os.path.split(final)
    old = final + REPLACED
    shutil.rmtree(old, ignore_errors=True)  # ours: left by a save killed before its last line
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(partial, final)
    point_latest(save_dir, tag)
    shutil.rmtree(old, ignore_errors=True)


def save(save_dir, iteration, model_state, run_state, rank_state, write_model_state, group=None):
    """Write one checkpoint from every rank (write_files' arguments). A failure on any rank (a full disk) removes
    the partial directory and raises ValueError on every rank. group: the process group of its barriers (an
    AsyncWriter's own, off the training's)."""
    tag = f"global_step{iteration}"
    final, partial = os.path.join(save_dir, tag), os.path.join(save_dir, tag + PARTIAL)
    old = final + REPLACED
    g = parallel.grid
    rank0 = g.rank == 0
    written = []

    def prepare():
        if rank0:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # debris of a crash during an earlier save
            os.makedirs(partial)

    def write():
        return _entry_numbers(
            write_files(partial, model_state, run_state, rank_state, write_model_state), g
        )

    def publish():
        if rank0:
            write_manifest(partial, written)
            files.fsync_dir(partial)
            _replace(partial, final)

    for work in (prepare, write, publish):
        failure, results = _phase(work, group)
        if work is write and failure is None:  # every rank's entries, for the manifest
            written = [
                _entries(
                    numbers, parallel.Grid(g.tp_size, g.pp_size, world_size=len(results), rank=r)
                )
                for r, numbers in enumerate(results)
            ]
        if failure is not None:
            if rank0:
                if os.path.isdir(old) and not os.path.exists(final):  # failed between the renames
                    os.replace(old, final)
                shutil.rmtree(partial, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(save_dir, LATEST + ".tmp"))
            code, message = failure
            problem = "no space left on device" if code == errno.ENOSPC else message
            raise ValueError(
                f"saving checkpoint {final} failed: {problem}. The partial checkpoint was removed and "
                f"{os.path.join(save_dir, LATEST)} still names the previous one; free space (or fix the "
                "directory) and resume"
            )
    return final


class AsyncWriter:
    """Checkpoints written by a background thread while training goes on (async_save): save() copies the state
    to host memory -- the only time the loop waits -- and returns; the thread writes it exactly as save() does,
    so the manifest comes last and `latest` moves only once every rank's files are complete, and a crash (even
    kill -9) mid-write leaves `latest` at the previous checkpoint. One save at a time: the next save, wait() and
    leaving the `with` block wait for the one in flight, and re-raise its error in the main thread.

    The host copies go to buffers kept from one save to the next (pinned for CUDA tensors, copied without
    blocking, then one stream sync): as much host memory as the state, but no allocation per save. The thread's
    barriers run on a gloo group of their own, never beside the training's collectives on the default group.
    enabled=False: save() is checkpoint.save, synchronous."""

    def __init__(self, enabled=True):
        self.enabled, self.thread, self.error, self.buffers = enabled, None, None, {}

    def save(self, save_dir, iteration, model_state, run_state, rank_state, write_model_state):
        """Returns when the state is safe from the training (copied, for async); the path the checkpoint will
        have."""
        # every rank saves at the same iteration, in step: the host group is made at the first (DeepSpeed may start
        # the process group late), and a slow write waits there with its own timeout, not the training's
        group = parallel.host_group() if dist.is_initialized() else None
        if not self.enabled:
            return save(
                save_dir,
                iteration,
                model_state,
                run_state,
                rank_state,
                write_model_state,
                group=group,
            )
        self.wait()  # the previous write is done before its buffers are reused
        payload = self._copy((model_state, run_state, rank_state))
        path = os.path.join(save_dir, f"global_step{iteration}")
        self._start(
            lambda: save(save_dir, iteration, *payload, write_model_state, group=group),
            f"checkpoint {iteration}",
            f"saved checkpoint {path}",
        )
        return path

    def write(self, path, obj):
        """One rank's file, written atomically (no manifest, no barrier: a spike-guard snapshot on local disk);
        in the background when enabled. Returns when obj is safe from the training."""
        if not self.enabled:
            atomic_write(obj, path)
            return
        self.wait()
        payload = self._copy(obj)
        self._start(lambda: atomic_write(payload, path), f"file {path}", None)

    def _copy(self, obj):
        payload, landed = host_copy(obj, self.buffers)
        if landed is not None:
            landed.synchronize()  # the non-blocking copies have landed
        return payload

    def _start(self, work, what, done):
        self.thread = threading.Thread(
            target=self._write, args=(work, what, done), name=what.replace(" ", "-")
        )
        self.thread.start()

    def _write(self, work, what, done):
        start = time.perf_counter()
        try:
            work()
        except BaseException as e:  # re-raised by wait(), in the main thread
            self.error = e
            if parallel.grid.rank == 0:
                print(
                    f"the background write of {what} failed; the run stops at its next write (or its end) and says "
                    "why",
                    flush=True,
                )
            return
        if done and parallel.grid.rank == 0:
            print(
                f"{done} (written in the background in {time.perf_counter() - start:.2f} s)",
                flush=True,
            )

    def wait(self):
        """Until the save in flight (if any) is on disk and published; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None:
            self.wait()
        else:  # the run failed: still let the write finish (its files are whole or absent), keep the run's error
            with contextlib.suppress(Exception):
                self.wait()
        return False


def tensors(obj):
    """Every tensor in obj, through dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def pinned_bytes(nbytes):
    """Host memory a pinned buffer of nbytes takes: CUDA's caching host allocator (ATen's CachingHostAllocator.h,
    allocate()) rounds every request up to a power of two (c10::llvm::PowerOf2Ceil; no threshold unless
    PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold), so a 1.1 GiB tensor's copy holds 2 GiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


_ATOMS = {int, float, bool, str, type(None)}  # values a list holds that need no copy of their own


def to_host(obj, buffers, key=()):
    """A copy of obj whose tensors are in host memory, in buffers[key path] (reused when shape and dtype match;
    pinned, and filled without blocking, for CUDA tensors); other values deep-copied."""
    if torch.is_tensor(obj):
        t = obj.detach()
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return buffer.copy_(t, non_blocking=t.is_cuda)
    if isinstance(obj, dict):
        return {k: to_host(v, buffers, (*key, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        # the run's history (2 x 1,024 numbers): no walk per number
        if all(type(v) in _ATOMS for v in obj):
            return type(obj)(obj)
        return type(obj)(to_host(v, buffers, (*key, i)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def host_copy(obj, buffers):
    """(to_host's copy, event): the event, recorded on the compute stream after the non-blocking copies, says
    when they have landed; None without CUDA tensors, where the copy is complete on return. Wait on it before
    reading the copy (a snapshot: only when a rollback reads it back)."""
    out = to_host(obj, buffers)
    event = None
    if any(t.is_cuda for t in tensors(obj)):
        event = torch.cuda.Event()
        event.record()
    return out, event


PARTIAL = ".partial"  # a checkpoint (or an export) still being written: never one to read
# Megatron-DeepSpeed's pipeline files: what megatron_ds reads, and what a resume names as needing its import
MEGATRON_DS_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
# a checkpoint set aside while a new save of its iteration takes its place (save's publish)
REPLACED = ".replaced"


def half_finished(directory):
    """The global_stepN.partial directories in directory, sorted: checkpoints whose writing (a save,
    an import) was killed before it completed."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        n for n in os.listdir(directory) if n.startswith("global_step") and n.endswith(PARTIAL)
    )


def describe_half_finished(directory, names):
    """What a global_stepN.partial is and what to do with it, for a message."""
    paths = " ".join(os.path.join(directory, n) for n in names)
    what = "is a checkpoint" if len(names) == 1 else "are checkpoints"
    return (
        f"{', '.join(names)} {what} whose writing was killed before it completed (a save or "
        "an import that did not finish): nothing in it can be resumed or exported; delete it "
        f"(rm -r {paths}) and save or import again"
    )


def _refuse_a_checkpoint_for_its_directory(directory):
    """load and save name a directory of checkpoints: one checkpoint's directory in their place held no
    `latest`, so the run trained from scratch (and would save checkpoints inside the checkpoint)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if MANIFEST in names or any(
        re.fullmatch(r"mp_rank_\d+_\d+_model_states\.pt", n) for n in names
    ):
        parent, tag = os.path.split(os.path.normpath(directory))
        raise ValueError(
            f"{directory} is a checkpoint, not a directory of checkpoints: give its directory ({parent}), "
            f"whose '{LATEST}' file names the checkpoint to resume (echo {tag} > {os.path.join(parent, LATEST)})"
        )


def check_directory(load_dir):
    """Refuse a load_dir that is no directory, in the words of what it is: a file given for it is
    not said to be missing (the tools read DIR/latest, which a file has not)."""
    if os.path.isfile(load_dir):
        raise ValueError(
            f"{load_dir} is a file, not a checkpoint directory: give the directory the run saved "
            f"its checkpoints into (it holds the '{LATEST}' file)"
        )
    if not os.path.isdir(load_dir):
        raise ValueError(f"checkpoint directory {load_dir} does not exist")


def latest_dir(load_dir):
    """The directory `latest` names, or None when load_dir holds no checkpoint yet. A
    global_stepN.partial is none: a directory holding one and no `latest` is refused, naming it."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        _refuse_a_checkpoint_for_its_directory(load_dir)
        partials = half_finished(load_dir)
        names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
        if any(n.startswith("global_step") and n not in partials for n in names):
            also = f" ({describe_half_finished(load_dir, partials)})" if partials else ""
            raise ValueError(
                f"{load_dir} has global_step* directories but no '{LATEST}' file; "
                "write the tag of the checkpoint to resume from into "
                f"{path} (e.g. echo global_step300 > {path}){also}"
            )
        if partials:
            raise ValueError(
                f"{load_dir} holds no checkpoint: {describe_half_finished(load_dir, partials)}"
            )
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not tag or os.sep in tag or tag in (".", ".."):
        raise ValueError(
            f"{path} holds {tag!r}, which names no checkpoint: write the tag of a complete checkpoint into it "
            f"(e.g. echo global_step300 > {path})"
        )
    tag_dir = os.path.join(load_dir, tag)
    if tag.endswith(PARTIAL):
        raise ValueError(
            f"{path} names {tag!r}, which is no checkpoint: "
            f"{describe_half_finished(load_dir, [tag])}; point '{LATEST}' at a "
            "complete global_step* directory"
        )
    if not os.path.isdir(tag_dir) and os.path.isdir(tag_dir + REPLACED):
        raise ValueError(
            f"a save replacing {tag_dir} was killed between its two renames: {tag}{PARTIAL} is the new checkpoint "
            f"(whole: its manifest is written) and {tag}{REPLACED} the one it replaced; resume from either by "
            f"renaming it: mv {tag_dir}{PARTIAL} {tag_dir} (or mv {tag_dir}{REPLACED} {tag_dir})"
        )
    if not os.path.isdir(tag_dir):
        raise ValueError(
            f"{path} names {tag!r} but {tag_dir} does not exist; point '{LATEST}' at an existing "
            "global_step* directory"
        )
    return tag_dir


STEP = re.compile(r"global_step(\d+)")


def _steps_beside(tag_dir):
    """(its directory, tag_dir's iteration or None, the iterations of every global_stepN there, in order)."""
    save_dir, tag = os.path.split(os.path.normpath(tag_dir))
    step = STEP.fullmatch(tag)
    found = sorted(int(m.group(1)) for m in map(STEP.fullmatch, os.listdir(save_dir or ".")) if m)
    return save_dir, (int(step.group(1)) if step else None), found


def later(tag_dir):
    """The global_stepM directories beside tag_dir with M above its iteration, in order: an abandoned timeline's,
    after a rollback to an earlier `latest` (lesson 9)."""
    _, iteration, steps = _steps_beside(tag_dir)
    return [] if iteration is None else [f"global_step{n}" for n in steps if n > iteration]


def _earlier(tag_dir):
    """What to do about a damaged checkpoint: resume from the newest earlier one in the same directory."""
    save_dir, iteration, steps = _steps_beside(tag_dir)
    steps = [n for n in steps if iteration is None or n < iteration]
    if not steps:
        return f"there is no earlier checkpoint in {save_dir}: restore the file from a copy, or train from scratch"
    earlier = f"global_step{max(steps)}"
    return f"resume from {earlier} instead: echo {earlier} > {os.path.join(save_dir, LATEST)}"


def read_manifest(tag_dir):
    """A checkpoint's manifest (dict), or None for a checkpoint written before manifests existed."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict) or "topology" not in manifest:
            raise ValueError("no 'files' or 'topology'")
        # every reader indexes these sizes: a manifest without them is damaged, or not ours
        sizes = manifest["topology"]
        if not isinstance(sizes, dict) or not all(
            type(sizes.get(key)) is int and sizes[key] >= 1 for key in TOPOLOGY_KEYS
        ):
            raise ValueError(
                f"its topology does not give {', '.join(TOPOLOGY_KEYS)} (each 1 or more)"
            )
        if not all(
            isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("crc32"), str)
            for e in manifest["files"].values()
        ):
            raise ValueError("an entry of its 'files' has no 'bytes' or no 'crc32'")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(
            f"checkpoint manifest {path} cannot be read ({type(e).__name__}: {e}); the checkpoint is "
            f"damaged -- {_earlier(tag_dir)}"
        ) from None
    # a later layout of the files, read as this one, would be read wrong: refused, not guessed
    if manifest.get("format", MANIFEST_FORMAT) != MANIFEST_FORMAT:
        raise ValueError(
            f"checkpoint {tag_dir} is in format {manifest['format']!r} (its manifest.json), which this "
            f"version does not read (format {MANIFEST_FORMAT}): resume it with the code that wrote it"
        )
    return manifest


def file_crc32(path, chunk=1 << 24):
    """(size, CRC-32 as 8 hex digits) of a file, read in chunks."""
    crc = size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, f"{crc:08x}"


def check_file(path, manifest):
    """None if the file is whole (its size and CRC-32 are the manifest's), else what is wrong with it."""
    entry = manifest["files"].get(os.path.basename(path))
    if entry is None:
        return "it is not listed in the checkpoint's manifest"
    if not os.path.exists(path):
        return "it is missing"
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"it is truncated or overwritten: {size:,} bytes where the manifest says {entry['bytes']:,}"
    size, crc = file_crc32(path)
    if crc != entry["crc32"]:
        return f"its CRC-32 is {crc} where the manifest says {entry['crc32']}: it is corrupt (bit rot, or overwritten)"
    return None


_verified = set()  # (path, size, mtime) of the files already checked by this process
warned_no_manifest = False


def verify(path):
    """Check one checkpoint file against its directory's manifest before its tensors are read: one ValueError
    naming the file, what is wrong and the earlier checkpoint to resume from. A checkpoint without a manifest
    (written by an older version) is read unchecked, with a note the first time."""
    global warned_no_manifest
    tag_dir = os.path.dirname(path)
    manifest = read_manifest(tag_dir)
    if manifest is None:
        if not warned_no_manifest and parallel.grid.rank == 0:
            print(
                f"note: checkpoint {tag_dir} has no {MANIFEST} (written by an older version): its files are read "
                "without checking their sizes and checksums",
                flush=True,
            )
        warned_no_manifest = True
        return
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key in _verified:
        return
    problem = check_file(path, manifest)
    if problem is not None:
        raise ValueError(
            f"checkpoint file {path}: {problem}. Nothing was loaded; {_earlier(tag_dir)}"
        )
    _verified.add(key)


def read(path, what, mmap=False):
    """torch.load of a checkpoint file (memory-mapped with mmap=True: only the bytes used are read) after checking
    it against the manifest, or one ValueError naming the missing or corrupt file."""
    if not os.path.exists(path):
        raise ValueError(
            f"checkpoint file {path} ({what}) is missing; the checkpoint is incomplete or was written "
            "by another topology -- resume from another global_step* by editing 'latest'"
        )
    verify(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # truncated or corrupt file: say which
        raise ValueError(
            f"checkpoint file {path} ({what}) cannot be read ({type(e).__name__}: {e}); it is "
            "corrupt -- resume from another global_step* by editing 'latest'"
        ) from None


def load(tag_dir):
    """This rank's (model_state, run_state, rank_state) from a checkpoint directory, after checking that the
    checkpoint was written by the same TP/PP/DP topology."""
    model_blob = read(model_file(tag_dir), "model shard")
    saved, now = model_blob["topology"], topology()
    if saved != now:
        diff = ", ".join(
            f"{k} {saved[k]} (checkpoint) vs {now[k]} (now)" for k in now if saved[k] != now[k]
        )
        raise ValueError(
            f"checkpoint {tag_dir} was saved with another parallel layout: {diff}; load it with "
            "reshard.load"
        )
    return (
        model_blob["model"],
        model_blob["run"],
        read(rank_file(tag_dir), "optimizer and RNG state"),
    )


def saved_topology(tag_dir):
    """The TP/PP/DP sizes a checkpoint was written with: its manifest's, or (older checkpoints) from TP rank 0,
    stage 0's file, which every layout has."""
    manifest = read_manifest(tag_dir)
    if manifest is not None:
        return manifest["topology"]
    return read(model_file(tag_dir, parallel.Grid(world_size=1)), "model shard", mmap=True)[
        "topology"
    ]


# -----------------------------------------------------------------------------
# A saved run state, checked before it is used (lesson 17: every resume is a real one)

# The keys of run_state.RunState (tests/test_run_state_checks.py keeps the two the same): a key
# added there needs its entry here, and a migration for the checkpoints written before it.
RUN_STATE_KEYS = (
    "iteration",
    "consumed_samples",
    "consumed_tokens",
    "scheduler_samples",
    "scheduler_tokens",
    "optimizer_reset",
    "callbacks",
    "history",
    "hf_origin",
)
# The keys an older version did not write, each filled by what that version did -- named, and said
# at the resume: key -> (its value from the saved dict, the note). Any other key missing is refused:
# a default resumes another run in silence (consumed_samples 0 restarts the data order while the
# token count goes on).
MIGRATIONS = {
    "scheduler_samples": (
        lambda s: s["consumed_samples"],
        "consumed_samples, which the LR schedule followed before 0856c27",
    ),
    "scheduler_tokens": (
        lambda s: s["consumed_tokens"],
        "consumed_tokens, which the LR schedule followed before 0856c27",
    ),
    "history": (
        lambda s: {"loss": [], "grad norm": []},
        "empty, as none was kept before c2d4e22: the trend the soft skip and the spike "
        "guard judge a step against refills from here",
    ),
    "callbacks": (
        lambda s: {"spike_guard": s["spike_guard"]} if s.get("spike_guard") else {},
        "{'spike_guard': its state}, the stability layer's state kept alone before f54cd2f",
    ),
    "hf_origin": (
        lambda s: None,
        "None, as it was not kept before 2a414b5: an export reads the "
        "init_from_hf directory instead",
    ),
}
REQUIRED = ("iteration", "consumed_samples", "consumed_tokens", "optimizer_reset")  # since d635d5c
COUNTERS = (
    "iteration",
    "consumed_samples",
    "consumed_tokens",
    "scheduler_samples",
    "scheduler_tokens",
)
LEGACY_KEYS = {"spike_guard"}  # read by a migration (callbacks)


def checked_run_state(saved, config=None):
    """(a copy of the saved run state with every RunState key, the notes of the migrations it
    took), or one ValueError naming the key that is missing, of another type or out of its range.
    config: the saved config (a dict): its seq_length and batch schedule bound the counters."""
    if not isinstance(saved, dict):
        raise _damaged("the run state", f"is a {type(saved).__name__}, not a dict")
    unknown = sorted(set(saved) - set(RUN_STATE_KEYS) - LEGACY_KEYS)
    if unknown:
        raise _damaged(
            unknown[0],
            "is no key of this version's run state (a newer version or a "
            "fork wrote it): resuming here would drop it",
        )
    for key in REQUIRED:
        if key not in saved:  # every version wrote these: a damaged or hand-made state lacks it
            raise _damaged(
                key,
                "is missing, and no version of stablegpt wrote a run state without "
                "it: nothing can say where the run is",
            )
    state, notes = dict(saved), []
    for key in COUNTERS[:3]:
        _need_count(state, key)
    for key, (fill, note) in MIGRATIONS.items():
        if key not in state:
            state[key] = fill(state)
            notes.append(
                f"run state: {key} missing (a checkpoint of an older version), filled by "
                f"its migration: {note}"
            )
    notes += _migrate_reset(state)
    _check_ranges(state, config)
    _check_history(state["history"])
    for key, kind in (("callbacks", dict), ("hf_origin", (dict, type(None)))):
        if not isinstance(state[key], kind):
            what = "a dict" if kind is dict else "a dict or None"
            raise _damaged(key, f"is {_short(state[key])}, not {what}")
    return state, notes + _schedule_note(state, config)


def _damaged(key, problem):
    return ValueError(
        f"checkpoint run state: {key} {problem}. The checkpoint's run state is "
        "damaged (or was written by hand): resume from an earlier checkpoint by "
        "editing 'latest', or restore this one from a copy"
    )


def _need_count(state, key):
    value = state[key]
    if isinstance(value, np.integer):
        state[key] = value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _damaged(key, f"is {_short(value)}, not a count (an integer >= 0)")


def _check_ranges(state, config):
    """The counters against each other: an iteration draws at least one sample of at least one
    token, the LR schedule counts the applied iterations only, an optimizer reset happened at an
    iteration done."""
    for key in COUNTERS[3:]:
        _need_count(state, key)
    it, samples, tokens = state["iteration"], state["consumed_samples"], state["consumed_tokens"]
    if samples < it or (it == 0) != (samples == 0):
        raise _damaged(
            "consumed_samples", f"is {samples} after {it} iterations, each of which draws a batch"
        )
    seq_length = (config or {}).get("seq_length")
    most = samples * seq_length if isinstance(seq_length, int) else tokens
    if not samples <= tokens <= most:
        raise _damaged(
            "consumed_tokens", f"is {tokens} for {samples} samples of at most {seq_length} tokens"
        )
    for key, total in (
        ("scheduler_samples", "consumed_samples"),
        ("scheduler_tokens", "consumed_tokens"),
    ):
        if state[key] > state[total]:
            raise _damaged(
                key,
                f"is {state[key]}, more than the {state[total]} {total}: the LR "
                "schedule counts the applied iterations among those",
            )
    reset = state["optimizer_reset"]
    counts = (
        isinstance(reset, dict)
        and set(reset) == {"iteration", "warmup_iters", "updates"}
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in reset.values())
    )
    if reset is not None and not (
        counts
        and reset["iteration"] <= it
        and reset["updates"] <= min(reset["warmup_iters"], it - reset["iteration"])
    ):
        raise _damaged(
            "optimizer_reset",
            f"is {_short(reset)}, not None or {{'iteration': <= {it}, 'warmup_iters': >= 0, 'updates': "
            "<= warmup_iters and the iterations since}",
        )


def _migrate_reset(state):
    """An optimizer reset of a version before 'updates' (its lr=0 window counted in iterations, skipped ones
    too): the window's updates as that version counted them, so the resume goes on where it stood. Its note."""
    reset = state["optimizer_reset"]
    if (
        not isinstance(reset, dict)
        or "updates" in reset
        or set(reset) != {"iteration", "warmup_iters"}
    ):
        return []
    done = state["iteration"] - reset["iteration"]
    if not all(isinstance(v, int) for v in (done, reset["warmup_iters"])) or done < 0:
        return []  # refused by the range check, naming the key as it was saved
    state["optimizer_reset"] = {**reset, "updates": min(reset["warmup_iters"], done)}
    return [
        "run state: optimizer_reset without its updates (a checkpoint of an older version, whose lr=0 window "
        f"counted iterations): {state['optimizer_reset']['updates']} of its {reset['warmup_iters']}, as it counted"
    ]


def _schedule_note(state, config):
    """A note when consumed_samples is not what the saved config's batch schedule gives after
    `iteration` iterations: not refused -- a run may change global_batch_size when it resumes --
    but said."""
    config = config or {}
    try:
        batch = schedule.RampupBatchSize(
            config.get("rampup_batch_size"),
            config["global_batch_size"],
            config["micro_batch_size"],
            1,
        )
    except (KeyError, TypeError, ValueError):  # a hand-made config: nothing to compare with
        return []
    samples, left = 0, state["iteration"]
    while left and batch(samples) != batch.global_batch_size:  # the ramp-up, then the full batch
        samples, left = samples + batch(samples), left - 1
    samples += left * batch.global_batch_size
    if samples == state["consumed_samples"]:
        return []
    return [
        f"run state: consumed_samples is {state['consumed_samples']}, where the checkpoint's "
        f"batch schedule (global_batch_size {batch.global_batch_size}, rampup_batch_size "
        f"{config.get('rampup_batch_size')}) gives {samples} after {state['iteration']} "
        "iterations: the batch size changed during the run (or the run state is damaged); the "
        f"data order goes on from sample {state['consumed_samples']}"
    ]


def _check_history(history):
    """Two lists of numbers of one length: the losses and grad norms of the last applied steps."""
    if not isinstance(history, dict) or set(history) != {"loss", "grad norm"}:
        raise _damaged(
            "history", f"is {_short(history)}, not {{'loss': [numbers], 'grad norm': [numbers]}}"
        )
    for key, values in history.items():
        if not isinstance(values, list) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values
        ):
            raise _damaged("history", f"[{key!r}] is {_short(values)}, not a list of numbers")
    if len(history["loss"]) != len(history["grad norm"]):
        raise _damaged(
            "history",
            f"holds {len(history['loss'])} losses but "
            f"{len(history['grad norm'])} grad norms (one of each per applied step)",
        )


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -----------------------------------------------------------------------------
# Weight dumps around save and load: how the 176B team found the tied embedding's lost copy and its LayerNorm
# reset on reload (lesson 11). tools/compare_weight_dumps.py diffs them.


def dump_weights(directory, preamble, iteration, model):
    """Write this rank's parameters, exactly as they are, to directory/weight_dumps/debug-...-{preamble}.pt,
    whole or not at all (atomic_write: a kill mid-write leaves no dump that looks complete)."""
    g = parallel.grid
    out = os.path.join(directory, "weight_dumps")
    os.makedirs(out, exist_ok=True)
    name = (
        f"debug-{iteration}-pp{g.pp_rank}-tp{g.tp_rank}-dp{g.dp_rank}-global{g.rank}-{preamble}.pt"
    )
    weights = {n: p.detach().cpu().clone() for n, p in parallel.unwrap(model).named_parameters()}
    atomic_write(weights, os.path.join(out, name))
