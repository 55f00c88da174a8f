"""The spike guard: the chronicles' firefighting done by the run itself (lessons 8, 9, 21).

The tr8b-104B team watched the loss, rolled back to a checkpoint, skipped a window of data with
skip_train_iteration_range, lowered the LR or reset the optimizer, and relaunched -- by hand, for days. PaLM wrote
the recipe down (restart ~100 steps before the spike, skip 200-500 batches); OLMo-core automated its first rung
(skip a step more than 6 std above a 128-step window). The guard climbs the whole ladder, in one process:

  detect  the loss or the grad norm (its logarithm) of a step is more than `spike_guard_zscore` std above the mean
          of the last `spike_guard_window` applied steps, and above `spike_guard_ema_ratio` x its EMA; or the
          loss is NaN/inf;
          or (fp16) the loss scale has collapsed to min_loss_scale. Not before the LR warm-up is over and
          `spike_guard_min_steps` steps are recorded.
  act     (a) skip the update: no weight, Adam moment, step counter or LR-schedule change;
          (b) at the `spike_guard_max_skips`-th spike within `spike_guard_rewind` iterations: roll back to the
              newest snapshot (CPU copy, or disk checkpoint) before the spike window and add the window -- from
              `spike_guard_rewind` before the first spike to `spike_guard_skip_after` after the last -- to the
              run's skip ranges;
          (c) on a relapse (any later rollback): also multiply the LR by `spike_guard_lr_factor` and, with
              `spike_guard_reset_optimizer`, reset the optimizer with the lr=0 warm-up of lesson 8.
          Rollbacks and skipped iterations are capped; at a cap the run saves its last good state and exits
          with code 3 and a message.
  explain every decision is one `spike guard: ...` line, a record in metrics.jsonl and an entry in the run state
          of the checkpoint; a resumed run honours the skip ranges and the LR factor and never decides again.
          The highest-loss samples of a spiking batch are named and decoded, to find the bad input (lesson 9).

The guard's state has two parts. Its statistics (windows, EMAs) belong to the weights and are rolled back with
them; its decisions (skip ranges, LR factor, counters, the decision log) are history and never are.

Fault injection, to make a spike on purpose (Megatron-LM's --error-injection-*): `inject_bad_batch_iters`
replaces the batches of those iterations by random token ids (here), `inject_lr_iters` multiplies their LR by
`inject_lr_factor` (schedule.lr_at).
"""
import collections
import math
import os
import re

import torch
import torch.distributed as dist

import checkpoint
import parallel
import run_state
import schedule
from report import print0

EXIT_CODE = 3


class SpikeGuardStop(RuntimeError):
    """A cap was reached: the run saved its last good state and stops (train.py exits with EXIT_CODE)."""


# -----------------------------------------------------------------------------
# Detection and decisions


class SpikeGuard:
    def __init__(self, cfg, saved=None):
        self.cfg = cfg
        self.enabled = cfg.spike_guard
        window = cfg.spike_guard_window
        self.alpha = 2.0 / (window + 1)  # the EMA whose centre of mass matches the window's
        # statistics of applied steps: rolled back with the weights
        self.history = {"loss": collections.deque(maxlen=window), "grad norm": collections.deque(maxlen=window)}
        self.ema = {"loss": None, "grad norm": None}
        # decisions: never rolled back
        self.strikes = []  # iterations of the spikes of the current episode
        self.skip_ranges = []  # [start, end] inclusive, added by rollbacks
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped_iters = 0
        self.decisions = []
        self.pending = None  # why the current step is a spike (judge -> update)
        if saved:
            self.load_state_dict(saved)

    # -- state -----------------------------------------------------------------------------------------------

    def stats(self):
        return {"history": {k: list(v) for k, v in self.history.items()}, "ema": dict(self.ema)}

    def load_stats(self, stats=None):
        """The statistics of a snapshot or checkpoint (None: one written without the guard, start afresh)."""
        for k in self.history:
            self.history[k].clear()
            self.history[k].extend(stats["history"][k] if stats else [])
        self.ema = dict(stats["ema"]) if stats else {k: None for k in self.ema}

    def state_dict(self):
        return {"stats": self.stats(), "strikes": list(self.strikes), "skip_ranges": [list(r) for r in
                self.skip_ranges], "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                "skipped_iters": self.skipped_iters, "decisions": list(self.decisions)}

    def load_state_dict(self, sd):
        self.load_stats(sd["stats"])
        self.strikes = list(sd["strikes"])
        self.skip_ranges = [tuple(r) for r in sd["skip_ranges"]]
        self.lr_scale, self.rollbacks, self.skipped_iters = sd["lr_scale"], sd["rollbacks"], sd["skipped_iters"]
        self.decisions = list(sd["decisions"])

    # -- what the training loop asks -------------------------------------------------------------------------

    def skips(self, iteration):
        return schedule.in_ranges(iteration, self.skip_ranges)

    def armed(self, state):
        """Judging starts once the LR warm-up is over and spike_guard_min_steps steps are recorded."""
        return (self.enabled and schedule.warmed_up(self.cfg, state)
                and len(self.history["loss"]) >= self.cfg.spike_guard_min_steps)

    def judge(self, loss, grad_norm):
        """Before the update (called by train.train_step): why this step is a spike, or None."""
        cfg, reasons = self.cfg, []
        for name, value in (("loss", loss), ("grad norm", grad_norm)):
            # Grad norms are closer to log-normal (lesson 21: plotted on a log scale): judged as logarithms,
            # a healthy step 4x the mean is not 6 std out, a broken one 30x is.
            f = math.log if name == "grad norm" else float
            window = [f(max(v, 1e-30)) for v in self.history[name]]
            mean = sum(window) / len(window)
            std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
            x = f(max(value, 1e-30))
            z = (x - mean) / std if std > 0 else (math.inf if x > mean else 0.0)
            ratio = value / self.ema[name] if self.ema[name] > 0 else math.inf
            if z > cfg.spike_guard_zscore and ratio > cfg.spike_guard_ema_ratio:
                scale = " (of its log)" if name == "grad norm" else ""
                reasons.append(f"{name} {value:.4g} is {z:.1f} std{scale} above the mean of the last {len(window)} "
                               f"steps and {ratio:.2f}x its EMA")
        self.pending = "; ".join(reasons) or None
        return self.pending

    def update(self, iteration, outcome, loss, grad_norm, scaler):
        """After train_step: record an applied step, or decide what a spike calls for. Returns the decision
        (a dict: action skip | rollback | stop, with its reason and line) or None."""
        if outcome == "ok":
            for name, value in (("loss", loss), ("grad norm", grad_norm)):
                self.history[name].append(value)
                ema = self.ema[name]
                self.ema[name] = value if ema is None else ema + self.alpha * (value - ema)
            return None
        if not self.enabled:
            return None
        collapse = False
        if outcome == "spike":
            reason = self.pending
        elif outcome == "nan":
            reason = f"the loss is {loss}"
        elif outcome == "skipped" and not math.isfinite(grad_norm):
            if scaler.dynamic:  # an fp16 overflow is the loss scaler's business, until the scale has collapsed
                if scaler.scale > scaler.min_scale:
                    return None
                collapse, reason = True, f"the fp16 loss scale collapsed to {scaler.scale}"
            else:
                reason = f"the grad norm is {grad_norm}"
        else:
            return None  # skip_grad_norm_above: OPT's rule, not a spike
        self.pending = None
        cfg = self.cfg
        self.strikes = [s for s in self.strikes if iteration - s <= cfg.spike_guard_rewind] + [iteration]
        if not collapse and len(self.strikes) < cfg.spike_guard_max_skips:
            if outcome == "spike":
                self.skipped_iters += 1
            if self.skipped_iters > cfg.spike_guard_max_skipped_iters:
                return self._decide(iteration, "stop", reason, f"{self.skipped_iters} iterations skipped, more than "
                                    f"spike_guard_max_skipped_iters={cfg.spike_guard_max_skipped_iters}")
            what = "update skipped" if outcome == "spike" else "no update"
            decision = self._decide(iteration, "skip", reason, f"{what} (spike {len(self.strikes)} of "
                                    f"{cfg.spike_guard_max_skips} before a rollback)")
            self.decisions.append(decision)
            return decision
        start = max(1, self.strikes[0] - cfg.spike_guard_rewind)
        end = iteration + cfg.spike_guard_skip_after
        if self.rollbacks >= cfg.spike_guard_max_rollbacks:
            return self._decide(iteration, "stop", reason, f"another rollback would exceed spike_guard_max_rollbacks"
                                f"={cfg.spike_guard_max_rollbacks}", start=start)
        if self.skipped_iters + end - start + 1 > cfg.spike_guard_max_skipped_iters:
            return self._decide(iteration, "stop", reason, f"skipping iterations {start}-{end} would exceed "
                                f"spike_guard_max_skipped_iters={cfg.spike_guard_max_skipped_iters}", start=start)
        relapse = self.rollbacks > 0
        lr_scale = self.lr_scale * (cfg.spike_guard_lr_factor if relapse else 1.0)
        reset = relapse and cfg.spike_guard_reset_optimizer
        plan = f"roll back to before iteration {start} and skip iterations {start}-{end}"
        if relapse:
            plan += f"; relapse {self.rollbacks}: LR x{lr_scale:g} from now on"
            plan += ", optimizer reset with an lr=0 warm-up" if reset else ""
        return self._decide(iteration, "rollback", reason, plan, start=start, end=end, lr_scale=lr_scale,
                            reset_optimizer=reset)

    def _decide(self, iteration, action, reason, plan, **extra):
        decision = {"iteration": iteration, "action": action, "reason": reason, **extra}
        decision["line"] = f"spike guard: iteration {iteration}: {reason}: {plan}"
        print0(decision["line"])
        return decision

    def applied(self, decision, target):
        """Book a rollback (or the stop) once train.py has restored the run to iteration `target`."""
        if decision["action"] == "rollback":
            self.rollbacks += 1
            self.skip_ranges.append((decision["start"], decision["end"]))
            self.skipped_iters += decision["end"] - decision["start"] + 1
            self.lr_scale = decision["lr_scale"]
        self.strikes = []
        decision["restored_iteration"] = target
        self.decisions.append({k: v for k, v in decision.items()})


# -----------------------------------------------------------------------------
# Rolling back: snapshots of the whole run (run_state.capture: model, optimizer, schedules, counters, RNG), in
# memory or on disk


class Snapshots:
    """A CPU copy of the run every spike_guard_snapshot_interval iterations, enough of them to reach back
    spike_guard_rewind iterations; older ones are dropped. Without one, the disk checkpoints in `save`."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.interval = cfg.spike_guard_snapshot_interval if cfg.spike_guard else 0
        self.keep = math.ceil(cfg.spike_guard_rewind / self.interval) + 2 if self.interval else 0
        self.items = []  # (iteration, snapshot), oldest first

    def maybe_take(self, iteration, parts):
        if self.interval and iteration % self.interval == 0:
            self.items = [item for item in self.items if item[0] < iteration][-(self.keep - 1):]
            self.items.append((iteration, run_state.capture(parts, to_cpu=True)))

    def newest_before(self, start):
        """(iteration, snapshot) of the newest state at an iteration < start, from memory or else disk."""
        for it, snap in reversed(self.items):
            if it < start:
                return it, snap
        for directory in dict.fromkeys(d for d in (self.cfg.save, self.cfg.load) if d):
            if not os.path.isdir(directory):
                continue
            steps = [int(m.group(1)) for m in map(re.compile(r"global_step(\d+)$").match, os.listdir(directory))
                     if m and int(m.group(1)) < start]
            if steps:
                return max(steps), checkpoint.load(os.path.join(directory, f"global_step{max(steps)}"))
        return None

    def roll_back(self, decision, parts):
        """Carry out a rollback (or, for a stop, return to the last good state if there is one). Returns the
        iteration restored to, or None when there is nothing to roll back to."""
        found = self.newest_before(decision["start"]) if "start" in decision else None
        if found is None:
            if decision["action"] == "rollback":
                decision["action"] = "stop"
                decision["line"] = (f"spike guard: iteration {decision['iteration']}: no snapshot or checkpoint "
                                    f"before iteration {decision['start']} to roll back to")
                print0(decision["line"])
            parts.guard.applied(decision, None)
            return None
        target, snap = found
        run_state.restore(snap, parts, keep_payload=True)  # a snapshot can be rolled back to again
        self.items = [item for item in self.items if item[0] <= target]
        if decision.get("reset_optimizer"):
            run_state.reset_optimizer(parts, schedule.reset_warmup_iters(self.cfg, unset="auto"))
        parts.guard.applied(decision, target)
        print0(f"spike guard: rolled back to iteration {target}" + (
            f"; iterations {decision['start']}-{decision['end']} will be skipped" if decision["action"] ==
            "rollback" else ""))
        return target


# -----------------------------------------------------------------------------
# Naming the input behind a spike


@torch.no_grad()
def highest_loss_samples(model, batches, first_sample, cfg, count=3):
    """[(loss, sample index)] of the `count` samples with the highest loss in this global batch, one forward
    without dropout; all ranks take part (PP=1 only: a pipeline returns no per-sample losses)."""
    g, mbs = parallel.grid, cfg.micro_batch_size
    device = batches[0][0].device
    losses = torch.zeros(len(batches) * mbs * g.dp_size, device=device)
    was_training = model.training
    model.eval()
    for k, (x, y) in enumerate(batches):
        logits = model(x)
        per_sample = parallel.vocab_parallel_cross_entropy(logits, y, cfg.vocab_size)[0].float().mean(dim=1)
        start = k * mbs * g.dp_size + g.dp_rank * mbs
        losses[start:start + mbs] = per_sample
    model.train(was_training)
    if g.dp_group is not None and g.dp_size > 1:
        dist.all_reduce(losses, group=g.dp_group)  # each sample's slot is filled by one DP rank
    top = torch.topk(losses, min(count, losses.numel()))
    return [(loss, first_sample + i) for loss, i in zip(top.values.tolist(), top.indices.tolist())]


def name_samples(model, batches, first_sample, cfg, dataset, seqlen, iteration):
    """Print (and return) the highest-loss samples of a spiking batch, decoded."""
    import data
    if parallel.grid.pp_size > 1:
        print0(f"spike guard: iteration {iteration}: samples {first_sample}-{first_sample + cfg.global_batch_size - 1}"
            " (not ranked by loss with pipeline parallelism; tools/show_samples.py decodes them)")
        return []
    named = highest_loss_samples(model, batches, first_sample, cfg)
    for loss, index in named:
        print0(f"spike guard: iteration {iteration}: sample {index} (loss {loss:.3f}): "
            f"{data.sample_text(dataset, index, seqlen, 160, cfg.tokenizer_file)!r}")
    return named


# -----------------------------------------------------------------------------
# Fault injection


def inject_bad_batches(cfg, iteration, batches):
    """Random token ids in place of the batches of inject_bad_batch_iters, drawn from a generator seeded by
    (seed, iteration): the same on every rank and every resume, and no draw from the training RNG streams."""
    if not schedule.in_ranges(iteration, schedule.parse_iteration_ranges(cfg.inject_bad_batch_iters,
                                                                          "inject_bad_batch_iters")):
        return batches
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + iteration)
    out = []
    for x, y in batches:
        tokens = torch.randint(0, cfg.vocab_size, (x.shape[0], x.shape[1] + 1), generator=gen)
        out.append((tokens[:, :-1].to(x.device), tokens[:, 1:].to(y.device)))
    return out
