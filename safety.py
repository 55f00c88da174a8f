"""What a run checks before it touches anything, and how it stops when told to: nothing may lose a run.

Before the model is built (RunLock.__enter__), on rank 0, with the verdict shared by every rank:
  - which checkpoint to resume: `load`, or else `save` when it holds one -- the SLURM habit of passing the same
    directory to both (lesson 17); a `save` holding another run's checkpoint is never silently written over,
    and a `load` that does not exist is an error, not a fresh start;
  - the checkpoint's config against this run's: a different model is refused, key by key, before any tensor
    is read; the keys allowed to change (train_iters, the LR schedule with override_lr_scheduler, ...) are
    listed;
  - the checkpoint's run state (checkpoint.checked_run_state): a damaged key refused by name, an
    older version's missing key filled by its named migration, and said;
  - the save directory: created and writable now, not at the first save; and locked (DIR/lock holds the
    holder's host and pid) so that two runs cannot write one directory. A lock left by a dead process on this
    host is taken over;
  - the record of a stop on purpose that the last run here left (DIR/stopped.json, write_stopped): said, and
    moved aside to DIR/stopped_at_N.json, so that what a requeue script finds there is always this run's.
During the run, ExitSignal turns SIGTERM (what SLURM sends at its time limit) or SIGUSR1 (what the SLURM recipe
asks for ahead of it) into "finish this iteration, save, exit 0" (Megatron's exit_signal_handler);
exit_reason says when the job stops: on that signal, or at exit_interval / exit_duration_in_mins.
"""

import json
import os
import signal
import socket
import subprocess
import time
import types
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

import checkpoint
import optim
import parallel
import schedule
import sections
from checkpoint import CheckpointConfig
from model import GPTConfig
from sections import section

LOCK = "lock"
# why the last run in a save directory stopped on purpose (write_stopped)
STOPPED = "stopped.json"
METRICS = "metrics"  # report.MetricsFile's metrics.jsonl

# Model keys that do not change the weights' shapes or the function they compute: they may differ on resume.
# Every other GPTConfig field (shapes, activation, LayerNorms, attention scaling, ...) must match the checkpoint.
RESUMABLE_MODEL_KEYS = {
    "hidden_dropout",
    "attention_dropout",
    "embed_dropout",
    "checkpoint_activations",
    "z_loss",
    "init_method_std",
    "embed_init",
    "embed_init_std",
    "position_embedding_init",
    # the same attention function, computed otherwise (tools/export_hf.py exports each as is)
    "attention_backend",
    "unfused_attention",
    "apply_query_key_layer_scaling",
    "stable_attention",
    # the layout: checkpoint.load
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
}


# what the length of training in samples follows (schedule.Schedule.total_samples)
RUN_LENGTH_KEYS = (
    "train_iters",
    "train_samples",
    "train_tokens",
    "global_batch_size",
    "rampup_batch_size",
)
# what the training data's sample order follows (loader.build_data): a resume goes on at its sample count, in the
# new order (a blend's new weights, a later phase's mix)
DATA_ORDER_KEYS = ("data_source", "data_path", "use_bundled_corpus", "split", "seed")


def architecture_keys():
    return [f.name for f in fields(GPTConfig) if f.name not in RESUMABLE_MODEL_KEYS]


def _print0(*args):
    if parallel.grid.rank == 0:
        print(*args, flush=True)


def _on_rank0(fn):
    """fn() on rank 0; its result, or its ValueError, on every rank (the others would hang at a collective)."""
    box = [None, None]
    if parallel.grid.rank == 0:
        try:
            box[0] = fn()
        except ValueError as e:
            box[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise ValueError(box[1])
    return box[0]


# -----------------------------------------------------------------------------
# Which checkpoint to resume, and whether it is this run's model


def checkpoint_run(tag_dir):
    """The run dict stored in a checkpoint (its config, its run state; in TP rank 0, stage 0's file, which every
    layout has), its file checked against the manifest and memory-mapped: no tensor is read."""
    first = checkpoint.model_file(tag_dir, parallel.Grid(world_size=1))
    names = os.listdir(tag_dir) if os.path.isdir(tag_dir) else []
    if not os.path.exists(first) and any(map(checkpoint.MEGATRON_DS_LAYER_FILE.fullmatch, names)):
        load_dir = os.path.dirname(os.path.normpath(tag_dir))
        raise ValueError(
            f"checkpoint {tag_dir} was written by Megatron-DeepSpeed (layer_*-model_*-model_states.pt): import it "
            f"first, python tools/import_megatron_deepspeed.py --load {load_dir} --save DIR, then --load DIR"
        )
    return checkpoint.read(first, "model shard", mmap=True)["run"]


def _show(value):
    return repr(value) if isinstance(value, str) else str(value)


def _longer_context(key, then, current):
    """A longer seq_length is the same model with rotary or ALiBi positions (computed, no table of the length's
    size): a context-extension stage, which Megatron's resume allows too. Not a shorter one: the checkpoint's
    token counters bound each sample by the saved length (checkpoint.checked_run_state)."""
    return (
        key == "seq_length"
        and current["position_embedding_type"] != "learned"
        and current[key] > then[key]
    )


def _unread_by_both(key, then, current):
    """A key the model reads only while a switch is on (GPTConfig.SWITCHED), off in the checkpoint's model and in
    this one: activation beside swiglu (a checkpoint's, given before such a key was refused, and left out now)."""
    switch = sections.switched(GPTConfig).get(key)
    return switch is not None and not any(
        sections.switch_on(types.SimpleNamespace(**{**current, **model}), switch)
        for model in (then, current)
    )


def compare_configs(saved, current, tag_dir):
    """Refuse another model; return the lines describing the keys allowed to differ. saved, current:
    the checkpoint's config and this run's, as dicts (every key: the comparison is of the whole
    run)."""
    _refuse_another_model(saved, current, tag_dir)
    changed = []
    for key, value in saved.items():
        if key not in current:  # a newer version's or a fork's: said, as nothing here reads it
            changed.append(f"{key}: {_show(value)} (a key this version does not know: ignored)")
        elif key not in ("load", "save") and current[key] != value:
            changed.append(
                f"{key}: {_show(value)} -> {_show(current[key])}{_change_note(key, saved, current)}"
            )
    return changed


def _refuse_another_model(saved, current, tag_dir):
    """Another architecture, or the optimizer's state of the other path (native, DeepSpeed): refused."""
    # a key an older version did not save had its default then (a default derived from other keys, None,
    # cannot be told: left out)
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    then = {
        k: saved.get(k, defaults[k])
        for k in architecture_keys()
        if k in saved or defaults[k] is not None
    }
    arch = [
        k
        for k in then
        if then[k] != current[k]
        and not _longer_context(k, then, current)
        and not _unread_by_both(k, then, current)
    ]
    if arch:
        diff = ", ".join(
            f"{k} {_show(then[k])} (checkpoint{'' if k in saved else ': its default'}) vs {_show(current[k])} (now)"
            for k in arch
        )
        shorter = (
            " (a rotary or ALiBi model's seq_length may grow on resume, not shrink)"
            if "seq_length" in arch and current["position_embedding_type"] != "learned"
            else ""
        )
        raise ValueError(
            f"checkpoint {tag_dir} holds another model: {diff}{shorter}. Resume with the checkpoint's values, "
            "or train this model from scratch with another save directory"
        )
    # checkpoints stay ours under DeepSpeed, but its optimizer state is its own (deepspeed_engine.py): the other
    # path's cannot be read (DeepSpeed: "Empty ds_version in checkpoint", after the build)
    if bool(saved.get("deepspeed")) != bool(current["deepspeed"]) and not current["no_load_optim"]:
        writer = "DeepSpeed's" if saved.get("deepspeed") else "the native path's"
        raise ValueError(
            f"checkpoint {tag_dir} holds {writer} optimizer state, which deepspeed={current['deepspeed']} cannot "
            f"read: resume with deepspeed={bool(saved.get('deepspeed'))}, or set no_load_optim to go on from its "
            "weights with a fresh optimizer"
        )


def _change_note(key, saved, current):
    """What a changed key does to the resumed run, where it is not plain: the data's order or length, the LR
    schedule."""
    note = ""
    if key == "seq_length":
        note = (
            " (a longer context, the same weights: the data goes on at the same sample count, in samples "
            "of the new length)"
        )
    elif key in DATA_ORDER_KEYS:
        note = (
            " (the training data's order follows it: the run goes on at its sample count in the new order, "
            "which may give samples already read and skip others)"
        )
    # with no decay length of its own, the LR decays over the run: its length sets the schedule too
    length_sets_lr = saved.get("lr_decay_samples") is None and saved.get("lr_decay_tokens") is None
    if key in schedule.LR_KEYS or (length_sets_lr and key in RUN_LENGTH_KEYS):
        override = current["override_lr_scheduler"]
        note = " (override_lr_scheduler)" if override else " (needs override_lr_scheduler)"
        if key in RUN_LENGTH_KEYS:
            note += ": with lr_decay_samples unset the LR decays over the run's length"
    return note


def _latest(directory):
    return checkpoint.latest_dir(directory) if directory and os.path.isdir(directory) else None


def _same_dir(a, b):
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def resolve_resume(ckpt_cfg, eval_only, current):
    """Set ckpt_cfg.load (a CheckpointConfig) to the directory to resume from (or None); return
    (tag_dir, lines to print, the checkpoint's run state or None). eval_only: logging's key;
    current: the run's config as a dict, compared with the checkpoint's. Rank 0 only."""
    keys, lines = ckpt_cfg, []
    save_tag = _latest(keys.save)
    if keys.load is None and save_tag is not None:
        keys.load = keys.save
        lines.append(
            f"resuming from {save_tag}: save holds a checkpoint and load is unset (same directory for "
            "both, the SLURM habit)"
        )
    load, save = keys.load, keys.save
    if load is not None and not os.path.isdir(load) and not _same_dir(load, save):
        raise ValueError(
            f"load directory {load} does not exist; fix the path, or unset load to "
            "train from scratch"
        )
    load_tag = _latest(load) if load else None
    if save_tag is not None and not _same_dir(save, load) and not eval_only:
        raise ValueError(
            f"save directory {save} already holds checkpoint "
            f"{os.path.basename(save_tag)}, which this run (loading {load}) would "
            f"write over; resume it with --load {save} (or unset load), or pick a new "
            "save directory"
        )
    if eval_only and load_tag is None:
        raise ValueError(
            f"eval_only needs a checkpoint, but {load or save or 'no load directory'} "
            "holds none; set load to a directory with a 'latest' file"
        )
    if load_tag is None and load is not None and not _same_dir(load, save):
        # a load of its own that holds nothing is a wrong path, not a first job (which loads its save directory)
        raise ValueError(
            f"load directory {load} holds no checkpoint (no '{checkpoint.LATEST}' file); fix the path, or unset "
            "load to train from scratch"
        )
    abandoned = (
        checkpoint.later(load_tag) if load_tag and _same_dir(load, save) and not eval_only else []
    )
    if abandoned:
        # Megatron's way, and the seeds' (a rollback edits `latest`): said, since they are not this run's
        lines.append(
            f"{', '.join(abandoned)} in {save} (after {os.path.basename(load_tag)}: the timeline this resume "
            "leaves) will each be replaced if this run saves its iteration; copy them elsewhere to keep them"
        )
    saved_state = None
    if load_tag is not None:
        run = checkpoint_run(load_tag)
        changed = compare_configs(run["config"], current, load_tag)
        if changed:
            lines.append("keys changed since the checkpoint:\n    " + "\n    ".join(changed))
        # before anything is built: a damaged run state refused, an older version's migrated, said
        saved_state, notes = checkpoint.checked_run_state(run["state"], run["config"])
        lines += notes
        if not eval_only:
            lines += what_is_left(saved_state, run["config"], current, load_tag)
            check_lr_schedule(run["scheduler"], current, saved_state)
            check_optimizer_state(run["config"], current, saved_state)
    return load_tag, lines, saved_state


def check_optimizer_state(saved, current, state):
    """The optimizer's state in the checkpoint against this config, as run_state.load will meet it, before the
    model is built: another optimizer, changed Adam settings (optim.adam_changes) and fp32 against fp16/bf16
    (the masters, precision.py) were refused only after the build. Nothing to check when the state is not
    loaded: no_load_optim, or an optimizer reset due now. saved, current: the checkpoint's config and this
    run's (dicts); state: the checkpoint's run state."""
    # the optimizer's keys and the schedule's lr, as run_state.load hands them over
    keys = types.SimpleNamespace(**current)
    warmup = optim.reset_warmup_iters(keys, current["reset_optimizer_warmup_iters"])
    if current["no_load_optim"] or optim.reset_due(warmup, state):
        return
    optim.adam_changes(keys, saved)
    half = [bool(c.get("fp16") or c.get("bf16")) for c in (saved, current)]
    # DeepSpeed keeps its own masters (deepspeed_engine.py)
    if half[0] != half[1] and not current["deepspeed"]:
        was, now = ("fp16/bf16", "fp32") if half[0] else ("fp32", "fp16/bf16")
        raise ValueError(
            f"the checkpoint's optimizer state is from an {was} run, this run is {now}: the fp32 master weights "
            "do not carry over; resume with the checkpoint's fp16/bf16 setting, or set no_load_optim to start "
            "the optimizer (and its masters) from the weights"
        )


def check_lr_schedule(saved, current, state):
    """The checkpoint's LR schedule against this config's, as the resume will (AnnealingLR.load_state_dict, by
    value: Megatron's check), before the model is built: a changed length of a run whose decay follows it
    was refused only after the build. saved: the checkpoint's scheduler state; current: the config (a dict);
    state: the checkpoint's run state, where the schedule goes on from."""
    keys = section(schedule.ScheduleConfig, types.SimpleNamespace(**current))
    plan = schedule.Schedule(keys, parallel.grid.dp_size, current["seq_length"], state)
    try:
        plan.lr_schedule.load_state_dict(saved, override=current["override_lr_scheduler"])
    except ValueError as e:
        unset = keys.lr_decay_samples is None and keys.lr_decay_tokens is None
        why = (
            " (lr_decay_samples is unset: the decay follows the length of the run)" if unset else ""
        )
        raise ValueError(f"{e}{why}") from None


def what_is_left(state, saved, current, tag_dir):
    """Refuse a resume past the end of training, or a new skip_train_iteration_range wholly before the
    checkpoint (its batches are trained on: the lesson-9 rollback without its `latest` edited); lines for a
    run already complete and a new range partly before it. state: the checkpoint's run state; saved,
    current: its config and this run's."""
    it, lines = state["iteration"], []
    for key, done in (
        ("train_iters", it),
        ("train_samples", state["consumed_samples"]),
        ("train_tokens", state["consumed_tokens"]),
    ):
        limit = current.get(key)
        # a run of train_tokens ends at the first batch that reaches it, a little past it
        if key == "train_tokens" and limit is not None and done > limit and saved.get(key) == limit:
            done = limit
        if limit is not None and done > limit:
            raise ValueError(
                f"checkpoint {tag_dir} is past the end of training: {key}={limit}, and it is at {done}; raise "
                f"{key} to train on, or resume an earlier checkpoint (its tag into latest)"
            )
        if limit is not None and done == limit:
            lines.append(
                f"checkpoint {tag_dir} is at {key}={limit}: the run is complete, nothing to train"
            )
    before = set(saved.get("skip_train_iteration_range") or [])
    for text in current.get("skip_train_iteration_range") or []:
        if text in before:
            continue
        (start, end), *_ = schedule.parse_iteration_ranges([text])
        if end <= it:
            raise ValueError(
                f"skip_train_iteration_range {text} ends at or before the checkpoint's iteration {it}: those batches "
                f"are trained on already; to skip them, roll back: write the tag of a checkpoint before iteration "
                f"{start} into the save directory's latest (e.g. echo global_stepN > DIR/latest)"
            )
        if start <= it:
            lines.append(
                f"skip_train_iteration_range {text}: iterations {start}-{it} are trained on already (the "
                f"checkpoint's iteration is {it}); {it + 1}-{end} are skipped"
            )
    return lines


# -----------------------------------------------------------------------------
# The save directory: writable, and one run at a time


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def acquire_lock(directory, flag="--save", user="run", name=LOCK):
    """Create DIR/lock (DIR/`name`) naming this process, or refuse: one run per save directory (or one `user` per
    `flag`'s directory: the lab's campaigns lock their --out; a rank's spike guard snapshots, its own file in
    spike_guard_snapshot_dir). Returns the lock's path."""
    lock_name, name = name, flag.lstrip("-")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the {name} directory {directory} ({e.strerror}); choose another {flag}"
        ) from None
    path = os.path.join(directory, lock_name)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        **slurm_job(),
    }
    # tries again after taking over a stale lock, or after losing it to another run
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            gone = holder and _gone(holder, me)
            if gone:
                if _take_over(path, holder):
                    _print0(f"taking over the lock {path} of pid {holder['pid']}, {gone}")
                continue
            who = (
                f"host {holder.get('host')} pid {holder.get('pid')} since {holder.get('since')}"
                if holder
                else "an unreadable lock"
            )
            raise ValueError(
                f"{name} directory {directory} is in use by another {user} ({who}, in {path}); wait for "
                f"it to end or use another {flag} (delete the lock only if that {user} is gone)"
            ) from None
        except OSError as e:
            raise ValueError(
                f"{name} directory {directory} is not writable ({e.strerror}); fix its permissions or "
                f"choose another {flag}"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise ValueError(f"could not take the lock {path}; another run took it first")


def slurm_job():
    """This process's SLURM job, as a lock records it ({} outside SLURM): its id and how many times it was
    requeued."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    return {
        "slurm_job": os.environ["SLURM_JOB_ID"],
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }


def slurm_job_running(job):
    """True or False: SLURM still runs (or queues, or is ending) job; None: SLURM cannot be asked."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # "Invalid job id specified": a job that ended a while ago
        return False if "Invalid job id" in out.stderr else None
    # a job that ended lately is listed with its end state (for MinJobAge): the next job of a chain, started
    # after a time-limit kill or a node failure, would find its lock "held"; an unknown state counts as alive
    return any(state not in SLURM_ENDED for state in out.stdout.split())


SLURM_ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


def _gone(holder, me):
    """Why the process that holds a lock is gone, or '' when it may still run. On this host: its pid. On
    another host (a SLURM job chain resumes on other nodes after a crash): its SLURM job, an earlier
    incarnation of this very job (requeued: SLURM runs one at a time) or one that squeue no longer lists."""
    if holder.get("host") == me["host"]:
        return "" if alive(holder.get("pid")) else "which is no longer running"
    job = holder.get("slurm_job")
    if job is None:
        return ""  # cannot tell: refused
    if job == me.get("slurm_job") and holder.get("slurm_restart", 0) < me.get("slurm_restart", 0):
        return f"an earlier run of this SLURM job ({job}), requeued"
    if slurm_job_running(job) is False:
        return f"whose SLURM job {job} is no longer running (squeue)"
    return ""


def _read_lock(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _take_over(path, stale):
    """Remove the lock at path if it is still `stale`: True if this process removed it. Two runs that find one
    stale lock must not both go on, the slower deleting the lock the faster has just made: the lock is moved to
    a name of this process's first (one rename wins) and put back if it was no longer the stale one."""
    aside = f"{path}.stale.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another run took it over first
    if _read_lock(aside) == stale:
        os.remove(aside)
        return True
    try:  # a live run's lock: back in place, unless a third run has made one meanwhile
        os.link(aside, path)
    except FileExistsError:
        pass
    os.remove(aside)
    return False


def release_lock(path):
    try:
        with open(path) as f:
            if json.load(f).get("pid") != os.getpid():
                return  # not ours any more
        os.remove(path)
    except (OSError, ValueError):
        pass


class RunLock:
    """`with RunLock(cfg) as run_lock:` around a run: which checkpoint to resume (its config and
    run state checked), the save directory locked, and run_lock.exit_signal (SIGTERM, SIGUSR1)
    handled; the lock and the handlers are released on the way out whatever happens.
    run_lock.saved_state: the run state of the checkpoint to resume (a dict, on every rank), or
    None.

    It takes the whole config, one of the few parts that do: it compares every key with the
    checkpoint's, and the load directory it resolves is written back into the config that every
    part is then built from."""

    def __init__(self, cfg):
        self.cfg, self.lock_file, self.exit_signal, self.saved_state = cfg, None, None, None

    def __enter__(self):
        cfg = self.cfg
        ckpt_cfg = section(CheckpointConfig, cfg)

        def prepare():
            tag_dir, lines, saved_state = resolve_resume(ckpt_cfg, cfg.eval_only, asdict(cfg))
            lock = acquire_lock(ckpt_cfg.save) if ckpt_cfg.save and not cfg.eval_only else None
            try:
                lines.append(set_stopped_aside(ckpt_cfg.save) if lock else None)
                if lock and _latest(ckpt_cfg.save) is None:
                    lines.append(set_logs_aside(ckpt_cfg.save, cfg.tensorboard_dir is None))
            except ValueError:
                release_lock(lock)
                raise
            for line in filter(None, lines):
                print(line, flush=True)
            return ckpt_cfg.load, lock, saved_state

        # rank 0 decided for everyone (it may resume from save)
        cfg.load, lock, self.saved_state = _on_rank0(prepare)
        self.lock_file = lock if parallel.grid.rank == 0 else None
        self.exit_signal = ExitSignal(ckpt_cfg.exit_signal_handler, saves=ckpt_cfg.save is not None)
        return self

    def __exit__(self, *exc):
        if self.exit_signal:
            self.exit_signal.restore()
        if self.lock_file:
            release_lock(self.lock_file)
        return False


def write_stopped(directory, record):
    """DIR/stopped.json: why this run stopped on purpose, what it saved and what it asks before a
    resume, for a requeue script (docs/parallelism.md) -- under torchrun a stop's exit code 3
    arrives as 1, like a crash's. Written whole (a temporary file renamed), after the state it
    names is on disk."""
    checkpoint.atomic_write(json.dumps(record, indent=1), os.path.join(directory, STOPPED))


def set_logs_aside(directory, tensorboard):
    """A run in DIR where no checkpoint is: the logs of an earlier run that left none (killed before its first
    save) moved to metrics.K.jsonl (and tensorboard.K, when `tensorboard`: this run's TensorBoard goes there),
    K the first free number, and said in a line (None when there are none). Appended to, they would read as this
    run's own past."""
    logs = [(METRICS, ".jsonl")] + ([("tensorboard", "")] if tensorboard else [])
    present = [
        (name, ext) for name, ext in logs if os.path.exists(os.path.join(directory, name + ext))
    ]
    if not present:
        return None
    k = 1
    while any(os.path.exists(os.path.join(directory, f"{name}.{k}{ext}")) for name, ext in logs):
        k += 1
    moved = []
    for name, ext in present:
        os.replace(os.path.join(directory, name + ext), os.path.join(directory, f"{name}.{k}{ext}"))
        moved.append(f"{name}{ext} to {name}.{k}{ext}")
    return (
        f"{directory} holds no checkpoint but the logs of a run before this one: moved {' and '.join(moved)}, "
        "so that this run's are not read as its continuation"
    )


def set_stopped_aside(directory):
    """A new run in DIR: the last run's stop record, if any, moved to DIR/stopped_at_N.json (kept,
    never removed) and said in a line (returned; None without one)."""
    path = os.path.join(directory, STOPPED)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        at = int(record["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(
            f"{path} is not a stop record this code wrote (a damaged or foreign file): read it, "
            "move it out of the save directory, then start again"
        ) from None
    # a run stopped twice at one iteration (a rollback, a requeue that stopped again) keeps both records
    aside, n = os.path.join(directory, f"stopped_at_{at}.json"), 1
    while os.path.exists(aside):
        aside, n = os.path.join(directory, f"stopped_at_{at}.{n}.json"), n + 1
    os.replace(path, aside)
    return (
        f"the last run in {directory} stopped on purpose at iteration {at} ({record.get('cause')}): "
        f"{record.get('next')}; its record moved to {aside}"
    )


# -----------------------------------------------------------------------------
# SIGTERM: save and exit cleanly (lesson 17)


class ExitSignal:
    """Remembers a SIGTERM or SIGUSR1; `exit_signal()` is its name ("SIGUSR1", true) on every rank at the same
    iteration once any rank got one, and logs it: a run stopped ahead of its time limit says which signal stopped
    it. SIGUSR1 is the SLURM recipe's (docs/parallelism.md: `#SBATCH --signal=USR1@600`, srun starting the
    workers): torchrun turns a SIGTERM into a SIGTERM to its workers and kills them 30 s later, before a large
    model's save ends; a SIGUSR1 that SLURM sends each task, minutes ahead, leaves them the time."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, enabled, saves=True, signums=SIGNALS):
        # received: the signal's number, 0 for none
        self.received, self.said, self.previous, self.saves = 0, False, {}, saves
        if enabled:
            self.previous = {signum: signal.signal(signum, self._handler) for signum in signums}

    def _handler(self, signum, frame):
        # only a number: the loop saves at the end of the iteration
        self.received = max(self.received, signum)

    def __call__(self):
        """Called every iteration: False, or the name of the signal ("SIGUSR1", "SIGTERM") once any rank got one.
        With the handler on, one all-reduce of the signal's number on the backend's device (no object collective:
        those pickle on the host and sync) and one host read of it; MAX, so every rank names the same signal
        (SIGTERM when ranks got different ones: the time limit's)."""
        if not self.previous:
            return False
        received = self.received
        if dist.is_initialized():
            # filled on the device (the number is the kernel's scalar): no host-built tensor copied over
            flag = torch.full((1,), received, dtype=torch.int32, device=parallel.comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        if not received:
            return False
        name = signal.Signals(received).name
        if not self.said:  # the log says which signal asked, whatever the caller prints
            self.said = True
            # with no save directory nothing is saved: the line must not say it is
            what = (
                "saving and exiting"
                if self.saves
                else "exiting, with nothing saved (save is not set),"
            )
            _print0(f"exit_signal_handler: {name} received; {what} at the end of this iteration")
        return name

    def restore(self):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous = {}


# -----------------------------------------------------------------------------
# When the job stops: after a count, on a clock or on a signal, every rank at the same iteration
# (lesson 17). Its keys are declared with checkpointing's (checkpoint.CheckpointConfig); the
# decision sits here, beside ExitSignal, its third cause.


def exit_reason(ckpt_cfg, iteration, job_start, exit_signal):
    """Why this job stops after the run's iteration `iteration` (exit_interval: at its multiples, as
    Megatron's; exit_duration_in_mins: on the job's clock; a SIGTERM or SIGUSR1), or None.
    exit_signal() takes part in a collective on every iteration: it is always called."""
    duration, interval = ckpt_cfg.exit_duration_in_mins, ckpt_cfg.exit_interval
    clock = (interval is not None and iteration % interval == 0) or (
        duration is not None and minutes_since(job_start) >= duration
    )
    signal_name = exit_signal()
    unsaved = "; nothing saved: save is not set" if ckpt_cfg.save is None else ""
    if signal_name:
        return f"{signal_name} (exit_signal_handler){unsaved}"
    return f"exit_interval / exit_duration_in_mins{unsaved}" if clock else None


def minutes_since(start):
    """Elapsed minutes, agreed across ranks (rank 0's clock): all exit at the same iteration."""
    return parallel.broadcast_scalars([(time.time() - start) / 60.0], src=0)[0]
