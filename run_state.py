"""Where a run is, captured and restored in one place: for checkpoints and for the spike guard's snapshots.

    parts = Parts(cfg, model, optimizer, schedule, scaler, guard)   # the live objects; parts.state: RunState
    payload = capture(parts)           # (model_state, run, rank_state): the layout of a checkpoint's files
    restore(payload, parts)            # weights, optimizer, LR schedule, loss scale, counters, guard statistics, RNG
    save(parts); load(parts)           # the payload on disk (checkpoint.py writes it, reshard.py re-cuts it)

A checkpoint and a snapshot hold the same payload, so a rollback to either is the same run (a test holds them
equal), and a resumed run continues bit-exactly: every number that decides what happens next is in it.
The optimizer reset of lesson 8 is here too (reset_optimizer): resuming with reset_optimizer_warmup_iters and a
spike guard's relapse both go through it. Not here: how the files are written (checkpoint.py), what the
numbers mean for the next iteration (schedule.py).
"""
import copy
import random
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

import checkpoint
import parallel
import reshard
import rng
import schedule
from report import print0


@dataclass
class RunState:
    """The numbers of a run besides its weights and optimizer; a checkpoint keeps them as a dict under "state"."""

    iteration: int = 0  # iterations done, skipped ones included
    consumed_samples: int = 0  # samples drawn, also by skipped iterations (lesson 9)
    consumed_tokens: int = 0
    # The LR schedule advances only with applied updates (Megatron steps its scheduler only when the update
    # succeeded: not on fp16 overflows nor on skip_train_iteration_range), hence its own sample/token counters.
    scheduler_samples: int = 0
    scheduler_tokens: int = 0
    optimizer_reset: dict | None = None  # {"iteration", "warmup_iters"} of the last reset (lesson 8)
    spike_guard: dict | None = None  # the guard's state_dict as of the last capture: decisions outlive a resume

    def advance(self, batch_size, seqlen, applied):
        """One iteration done: its batch drawn, and counted by the LR schedule if its update was applied."""
        if applied:
            self.scheduler_samples += batch_size
            self.scheduler_tokens += batch_size * seqlen
        self.iteration += 1
        self.consumed_samples += batch_size
        self.consumed_tokens += batch_size * seqlen

    def load(self, saved):
        """Every field from a saved dict (a copy: a snapshot may be restored again); missing ones at default."""
        for f in fields(self):
            value = saved[f.name] if f.name in saved else f.default
            setattr(self, f.name, copy.deepcopy(value))


@dataclass
class Parts:
    """The live objects whose state a checkpoint or a snapshot holds."""

    cfg: object
    model: object  # this rank's stage (or the DeepSpeed engine around it: parallel.unwrap)
    optimizer: object
    schedule: schedule.Schedule  # its AnnealingLR remembers the end of a sample warm-up in tokens
    scaler: object  # optim.LossScaler
    guard: object  # spike_guard.SpikeGuard
    state: RunState = field(default_factory=RunState)


def capture(parts, to_cpu=False):
    """The payload (model_state, run, rank_state) as checkpoint.save writes it and checkpoint.load returns it.
    to_cpu: every tensor copied to the CPU, so that the payload does not alias live state (a snapshot)."""
    p = parts
    p.state.spike_guard = p.guard.state_dict()
    model_state = parallel.unwrap(p.model).state_dict()
    run = {"state": asdict(p.state), "scheduler": p.schedule.lr_schedule.state_dict(),
           "scaler": p.scaler.state_dict(), "config": asdict(p.cfg)}
    rank_state = {"optimizer": p.optimizer.state_dict(), "rng": checkpoint.rng_state(),
                  # what another layout needs to find this state by parameter name (reshard.py)
                  "param_names": None if p.cfg.deepspeed else reshard.param_names(p.model, p.optimizer)}
    payload = (model_state, run, rank_state)
    return cpu_copy(payload) if to_cpu else payload


def restore(payload, parts, optimizer=True, rng_state=True, keep_payload=False):
    """Put the run back to a payload. The LR schedule is checked first (a changed one is refused without
    override_lr_scheduler, lesson 10). optimizer / rng_state=False: leave those as they are (a fresh optimizer,
    fresh streams). keep_payload: the optimizer gets a copy, so that the payload can be restored again."""
    model_state, run, rank_state = payload
    p = parts
    p.schedule.lr_schedule.load_state_dict(run["scheduler"], override=p.cfg.override_lr_scheduler)
    parallel.unwrap(p.model).load_state_dict(model_state)  # strict: every parameter of every stage (lesson 11)
    p.scaler.load_state_dict(run["scaler"])
    p.state.load(run["state"])
    # the guard's statistics go with the weights (its decisions never do: they are history)
    p.guard.load_stats((p.state.spike_guard or {}).get("stats"))
    if optimizer:
        # load_state_dict keeps tensors that already have the right device and dtype: a payload kept gives a copy
        p.optimizer.load_state_dict(copy.deepcopy(rank_state["optimizer"]) if keep_payload else rank_state["optimizer"])
    if rng_state and rank_state["rng"] is not None:
        checkpoint.set_rng_state(rank_state["rng"])


def reset_optimizer(parts, warmup_iters):
    """Lesson 8's reset, at the current iteration: Adam from step 0 with zero moments, then warmup_iters iterations
    at lr=0 (schedule.lr_at). Recorded in the run state, so a resumed run keeps the window and never resets again."""
    state = getattr(parts.optimizer, "state", None)  # DeepSpeed's is only reset at a resume, where it is fresh
    if state:
        state.clear()
    parts.state.optimizer_reset = {"iteration": parts.state.iteration, "warmup_iters": warmup_iters}


def cpu_copy(obj):
    """A deep copy with every tensor copied to the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


# -----------------------------------------------------------------------------
# On disk


def save(parts):
    cfg, iteration = parts.cfg, parts.state.iteration
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.save, "before-save", iteration, parts.model)
    path = checkpoint.save(cfg.save, iteration, *capture(parts), write_model_state=parallel.grid.dp_rank == 0)
    print0(f"saved checkpoint at iteration {iteration:8d} to {path}")


def load(parts):
    """Resume from cfg.load/latest if there is one, on any layout (reshard.py). Returns True when something was
    loaded. reset_optimizer_warmup_iters resets the optimizer here, once per run (lesson 8)."""
    cfg, state = parts.cfg, parts.state
    tag_dir = checkpoint.latest_dir(cfg.load)
    if tag_dir is None:
        print0(f"no checkpoint in {cfg.load}: training from scratch")
        return False
    warmup = schedule.reset_warmup_iters(cfg)
    saved = checkpoint.saved_topology(tag_dir)
    if saved == checkpoint.topology():
        payload = checkpoint.load(tag_dir)
    else:  # another TP x PP x DP layout: rebuilt from its slices (reshard.py)
        print0(f"resharding checkpoint {tag_dir}: saved with {reshard.describe(saved)}, now "
               f"{reshard.describe(checkpoint.topology())}")
        payload = reshard.load(tag_dir, saved, parts.model, parts.optimizer, cfg,
                               need_optimizer=not (cfg.no_load_optim or warmup))
    reset_now = warmup and payload[1]["state"].get("optimizer_reset") is None
    fresh = cfg.no_load_optim or reset_now
    restore(payload, parts, optimizer=not fresh, rng_state=not cfg.no_load_rng)
    if state.spike_guard:  # its decisions (skip ranges, LR factor) hold even with spike_guard off now
        parts.guard.load_state_dict(state.spike_guard)
    if reset_now:
        reset_optimizer(parts, warmup)
        print0(f"optimizer reset at iteration {state.iteration}: fresh optimizer, lr=0 for {warmup} iterations")
    elif warmup:
        print0(f"reset_optimizer_warmup_iters ignored: this run's optimizer was already reset at iteration "
               f"{state.optimizer_reset['iteration']}")
    if fresh:
        print0("optimizer state not loaded: starting from a fresh optimizer (step 0, zero moments)")
        if hasattr(parts.optimizer, "refresh_fp32_params"):  # fp32 master weights from the loaded weights
            parts.optimizer.refresh_fp32_params()
    if payload[2]["rng"] is None:
        # A resharded checkpoint: a rank's RNG streams do not map onto another layout's ranks. Fresh streams,
        # seeded as at the start of a run (rng.seed: per TP rank and stage) from a seed that differs from it.
        seed = cfg.seed + state.iteration
        rng.seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        print0(f"RNG states not restored (the layout changed): fresh streams seeded with seed + iteration = {seed}")
    print0(f"loaded checkpoint {tag_dir} at iteration {state.iteration}")
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.load, "after-load", state.iteration, parts.model)
    return True
