"""Where a run is, captured and restored in one place: for checkpoints and spike-guard snapshots.

    parts = Parts(cfg, model, optimizer, schedule, scaler, callbacks)  # the live objects, parts.state
    payload = capture(parts)    # (model_state, run, rank_state): the layout of a checkpoint's files
    restore(payload, parts)     # weights, optimizer, LR schedule, loss scale, counters, RNG streams
    save(parts), load(parts)    # on disk: checkpoint.py writes the files, reshard.py re-cuts them

A checkpoint and a snapshot are the same payload, so rolling back to either is the same run, and a
resumed run goes on bit-exactly: every number that decides what happens next is in it. The optimizer
reset of lesson 8 lives here too (reset_optimizer): a resume with reset_optimizer_warmup_iters and a
spike guard's relapse both go through it. The callbacks' own states (the stability layer's) ride along as
a name -> state map (training.Callbacks.state_dict), which this file carries without reading it.

Not here: how the files are written (checkpoint.py), what the counters mean for the next iteration
(schedule.py).
"""

import copy
import random
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

import checkpoint
import optim
import parallel
import reshard
import rng
from report import print0
from sections import section

# applied steps whose loss and grad norm the run state keeps: the trend a step is judged against
HISTORY = 1024


@dataclass
class RunState:
    """A run's numbers besides its weights and optimizer (a checkpoint's "state", as a dict)."""

    iteration: int = 0  # iterations done, skipped ones included
    consumed_samples: int = 0  # drawn, by skipped iterations too (lesson 9)
    consumed_tokens: int = 0
    # The LR schedule advances only with applied updates (Megatron steps its scheduler only when
    # the update succeeded: not on fp16 overflows nor on skip_train_iteration_range).
    scheduler_samples: int = 0
    scheduler_tokens: int = 0
    # {"iteration", "warmup_iters", "updates"} of the reset (lesson 8): updates, the applied ones at lr=0 so far
    optimizer_reset: dict | None = None
    # each callback's state at the last capture, by its name
    callbacks: dict = field(default_factory=dict)
    # the loss and grad norm of the last HISTORY applied steps, oldest first: the trend that the soft skip and the
    # spike guard judge a step against, kept (and rolled back) with the weights whether or not they are on
    history: dict = field(default_factory=lambda: {"loss": [], "grad norm": []})
    # the Hugging Face model init_from_hf started the run from (hf.origin): its token ids and context, which an
    # export keeps; here, not in the config, so that every resumed run carries it on without reading the model
    hf_origin: dict | None = None

    def advance(self, batch_size, seqlen, applied, step=None):
        """One iteration done: its batch drawn; counted by the LR schedule if its update applied, and its numbers
        (a training.Step's loss and grad norm) into the history."""
        if applied:
            self.scheduler_samples += batch_size
            self.scheduler_tokens += batch_size * seqlen
        reset = self.optimizer_reset
        # the warm-up is of the fresh moments: only an update that applied moved them (not a skipped batch)
        if applied and reset is not None and reset["updates"] < reset["warmup_iters"]:
            reset["updates"] += 1
        if applied and step is not None:
            for key, value in (("loss", step.loss), ("grad norm", step.grad_norm)):
                values = self.history[key]
                values.append(value)
                del values[:-HISTORY]
        self.iteration += 1
        self.consumed_samples += batch_size
        self.consumed_tokens += batch_size * seqlen

    def load(self, saved, config=None):
        """Every field of a saved dict, copied (a snapshot is used again), after
        checkpoint.checked_run_state: a key an older version did not write filled by its migration,
        a damaged one refused. config: the saved config (a dict), which bounds the counters."""
        saved, _ = checkpoint.checked_run_state(saved, config)
        for f in fields(self):
            setattr(self, f.name, copy.deepcopy(saved[f.name]))


def callback_states(saved):
    """The callbacks' states of a saved run state (a dict), by name. A checkpoint written before the callbacks had
    a map holds the stability layer's state alone, under "spike_guard"."""
    if "callbacks" in saved:
        return saved["callbacks"]
    return {"spike_guard": saved["spike_guard"]} if saved.get("spike_guard") else {}


@dataclass
class Parts:
    """The live objects whose state a checkpoint or a snapshot holds."""

    cfg: object
    model: object  # this rank's stage (or the DeepSpeed engine around it: parallel.unwrap)
    optimizer: object
    schedule: object  # schedule.Schedule: its AnnealingLR remembers where a sample warm-up ended
    scaler: object  # optim.LossScaler
    callbacks: object  # training.Callbacks: the stability layer's (or none)
    rules: object = None  # training.StepRules: what a step reads of cfg (builders.step_rules)
    state: RunState = field(default_factory=RunState)


def capture(parts):
    """The payload (model_state, run, rank_state), as checkpoint.save writes it and checkpoint.load
    returns it; its tensors are the live run's (checkpoint.host_copy copies them: snapshots, async saves)."""
    p = parts
    p.state.callbacks = p.callbacks.state_dict()
    model_state = parallel.unwrap(p.model).state_dict()
    run = {
        "state": asdict(p.state),
        "scheduler": p.schedule.lr_schedule.state_dict(),
        "scaler": p.scaler.state_dict(),
        "config": asdict(p.cfg),
    }
    # param_names: what another layout needs to find this optimizer state by name (reshard.py)
    names = None if p.cfg.deepspeed else reshard.param_names(p.model, p.optimizer)
    rank_state = {
        "optimizer": p.optimizer.state_dict(),
        "rng": checkpoint.rng_state(),
        "param_names": names,
    }
    return model_state, run, rank_state


def restore(payload, parts, optimizer=True, rng_state=True, keep_payload=False, lr_schedule=True):
    """Put the run back to a payload; the LR schedule first, which refuses a changed one without
    override_lr_scheduler (lesson 10). optimizer, rng_state, lr_schedule=False: keep those as they are (a
    fresh optimizer, fresh streams, this config's schedule). keep_payload: the optimizer gets a copy, the
    payload stays usable."""
    model_state, run, rank_state = payload
    p = parts
    if lr_schedule:
        p.schedule.lr_schedule.load_state_dict(
            run["scheduler"], override=p.cfg.override_lr_scheduler
        )
    parallel.unwrap(p.model).load_state_dict(model_state)  # strict: every parameter (lesson 11)
    saved = run.get("config") or {}
    if saved.get("fp16", True) and saved.get("loss_scale") is None:
        p.scaler.load_state_dict(run["scaler"])
    elif p.scaler.dynamic:
        # a bf16 or fp32 run's scaler is the static no-op one (scale 1): fp16 gradients would underflow at it
        print0(
            f"loss scale: the checkpoint's run had no dynamic loss scale; it starts at initial_loss_scale "
            f"{p.scaler.scale:g}"
        )
    p.state.load(run["state"], run.get("config"))
    # the callbacks' statistics go with the weights; their decisions are history and stay
    p.callbacks.load_state_dict(p.state.callbacks, p.state, resume=False)
    if optimizer:
        # load_state_dict keeps tensors of the right device and dtype: a kept payload gives a copy
        state = rank_state["optimizer"]
        p.optimizer.load_state_dict(copy.deepcopy(state) if keep_payload else state)
    if rng_state and rank_state["rng"] is not None:
        checkpoint.set_rng_state(rank_state["rng"])


def reset_optimizer(parts, warmup_iters):
    """Lesson 8's reset, at this iteration: Adam from step 0 with zero moments, then warmup_iters applied updates
    at lr=0 (schedule.lr_at; a skipped iteration is not one). In the run state: a resumed run keeps the window
    and resets once only."""
    state = getattr(parts.optimizer, "state", None)  # DeepSpeed's: reset only at a resume, fresh
    if state:
        state.clear()
    parts.state.optimizer_reset = {
        "iteration": parts.state.iteration,
        "warmup_iters": warmup_iters,
        "updates": 0,
    }


# -----------------------------------------------------------------------------
# On disk


def save(parts, writer=None):
    """A checkpoint of the run in cfg.save; by writer (a checkpoint.AsyncWriter) when given, in the background
    if it is enabled. The log says how long the training loop waited for it."""
    cfg, iteration = parts.cfg, parts.state.iteration
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.save, "before-save", iteration, parts.model)
    start = time.perf_counter()
    write = writer.save if writer is not None else checkpoint.save
    path = write(cfg.save, iteration, *capture(parts), write_model_state=parallel.grid.dp_rank == 0)
    how = (
        "saving checkpoint in the background"
        if writer is not None and writer.enabled
        else "saved checkpoint"
    )
    print0(
        f"{how} at iteration {iteration:8d} to {path} (the loop waited {time.perf_counter() - start:.3f} s)"
    )


def load(parts):
    """Resume from cfg.load/latest if there is one, on any layout (reshard.py); True if it did.
    With reset_optimizer_warmup_iters the optimizer is reset here, once per run (lesson 8)."""
    cfg, state = parts.cfg, parts.state
    tag_dir = checkpoint.latest_dir(cfg.load)
    if tag_dir is None:
        print0(f"no checkpoint in {cfg.load}: training from scratch")
        return False
    optim_cfg = section(optim.OptimizerConfig, cfg)
    warmup = optim.reset_warmup_iters(optim_cfg, cfg.reset_optimizer_warmup_iters)
    payload = _read_payload(parts, tag_dir, warmup)
    if cfg.eval_only:
        # it trains nothing: the optimizer's state, its settings and the LR schedule are not its business
        restore(payload, parts, optimizer=False, rng_state=not cfg.no_load_rng, lr_schedule=False)
        print0(f"loaded checkpoint {tag_dir} at iteration {state.iteration}")
        return True
    reset_now = optim.reset_due(warmup, payload[1]["state"])
    fresh = cfg.no_load_optim or reset_now
    restore(payload, parts, optimizer=not fresh, rng_state=not cfg.no_load_rng)
    if not fresh:  # the checkpoint's betas and eps came with its optimizer state
        line = optim.resume_adam_params(parts.optimizer, cfg, payload[1].get("config", {}))
        if line:
            print0(line)
    # their decisions (skip ranges, LR factor): builders.build_callbacks saw them, they hold
    if state.callbacks:
        parts.callbacks.load_state_dict(state.callbacks, state, resume=True)
    if reset_now:
        reset_optimizer(parts, warmup)
        print0(
            f"optimizer reset at iteration {state.iteration}: fresh optimizer, lr=0 for "
            f"{warmup} iterations (updates applied: a skipped one does not count)"
        )
    elif warmup:
        print0(
            f"reset_optimizer_warmup_iters ignored: this run's optimizer was already reset at "
            f"iteration {state.optimizer_reset['iteration']}"
        )
    if fresh:
        print0("optimizer state not loaded: starting from a fresh optimizer (step 0, zero moments)")
        if hasattr(parts.optimizer, "refresh_fp32_params"):  # masters from the loaded weights
            parts.optimizer.refresh_fp32_params()
    device = next(parallel.unwrap(parts.model).parameters()).device
    why = rng_not_restored(cfg, payload[2]["rng"], device)
    if why:
        _reseed(parts, why)
    print0(f"loaded checkpoint {tag_dir} at iteration {state.iteration}")
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.load, "after-load", state.iteration, parts.model)
    return True


def _read_payload(parts, tag_dir, warmup):
    """checkpoint.load(tag_dir)'s payload, rebuilt by reshard.py if saved on another layout, or with
    another pp_partition_method (the same stages holding other layers)."""
    cfg = parts.cfg
    saved = checkpoint.saved_topology(tag_dir)
    if saved != checkpoint.topology():
        how = f"saved with {reshard.describe(saved)}, now {reshard.describe(checkpoint.topology())}"
    else:
        payload = checkpoint.load(tag_dir)
        # a checkpoint of a version without the key: nothing to compare with
        method = payload[1]["config"].get("pp_partition_method", cfg.pp_partition_method)
        if _stages(cfg, method) == _stages(cfg, cfg.pp_partition_method):
            return payload
        how = f"saved with pp_partition_method {method!r}, now {cfg.pp_partition_method!r}"
    print0(f"resharding checkpoint {tag_dir}: {how}")
    layout = reshard.SavedLayout(tag_dir, saved)
    return reshard.load(
        layout,
        parts.model,
        parts.optimizer,
        deepspeed=cfg.deepspeed,
        use_bnb_optimizer=cfg.use_bnb_optimizer,
        # eval_only trains nothing; a reset done before the save is not due again (its key stays in the
        # config): its state goes on
        need_optimizer=not (
            cfg.no_load_optim or cfg.eval_only or optim.reset_due(warmup, layout.run["state"])
        ),
    )


def _stages(cfg, method):
    """The transformer layers of each of cfg's pipeline stages under a pp_partition_method."""
    return parallel.partition_layers(cfg.num_layers, cfg.pipeline_model_parallel_size, method)


def rng_not_restored(cfg, saved, device):
    """Why the checkpoint's RNG streams (checkpoint.rng_state) are not this run's to go on with, or None."""
    if cfg.no_load_rng:
        return "no_load_rng"
    if saved is None:
        return "the layout changed"
    # saved on a CPU, resumed on a GPU (or the reverse): no stream for the TP ranks' dropout here (rng.py)
    streams = saved.get("model_parallel")
    if streams is not None and torch.device(device).type not in streams:
        return f"saved on {', '.join(streams)}, now on {torch.device(device).type}"
    return None


def _reseed(parts, why):
    """Seeds fresh RNG streams where the saved ones are not restored: after a reshard (they are the old
    layout's ranks'), or with no_load_rng (the seed's own would repeat the run's first dropout masks)."""
    cfg, state = parts.cfg, parts.state
    # A rank's RNG streams do not map onto another layout's ranks. Fresh streams, seeded as at the
    # start of a run (per TP rank and stage) but from another seed.
    seed = cfg.seed + state.iteration
    rng.seed(seed, next(parallel.unwrap(parts.model).parameters()).device)
    np.random.seed(seed)
    random.seed(seed)
    print0(f"RNG states not restored ({why}): fresh streams seeded with seed + iteration = {seed}")
