"""One training step, evaluation, and the callbacks the loop calls around them.

    loss = backward(model, optimizer, scaler, batches, rules, device)   # the gradients, reduced
    step = train_step(model, optimizer, scaler, loss, lr, rules)        # the numbers, not applied
    step = apply_step(optimizer, step, lr, rules, factor)       # the update, x factor
    step = whole_step(model, optimizer, scaler, batches, lr, rules, device, callbacks)  # all three
    loss = evaluate(model, valid_data, rules, device)
    evaluate_only(model, valid_data, state, rules, device, split)      # eval_only
    print_sample(model, device, tokens, prompt, tokenizer_file, seed)  # the run's last word

The step computes; the callbacks decide. backward() runs forward and backward over this rank's
micro-batches (pipelined across stages) and reduces the gradients over data parallelism;
train_step() measures them (the grad norm, the step's one host sync, agree()) and says whether the
core would apply them (outcome(): an fp16 overflow, a NaN loss, skip_grad_norm_above, replicas that
differ); apply_step() clips and applies them, scaled by the callbacks' factor, or not at all (a
veto). The callbacks are asked between these calls, in the order whole_step() spells out (the
step train.py's loop takes, and every step outside it).
Every skip decision is taken from the same floats on every replica. `rules` is a StepRules: the
config's keys a step reads, built once (builders.step_rules).

The callbacks (Callback) are the named points where code outside the core acts on a run: the
stability layer (stability/) is a list of them. The dependency runs one way: the loop calls these,
and knows nothing else of what is behind them. This file sits below the loop (train.py) and the
stability layer, which both build on it.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

import data
import loader
import optim
import parallel
from report import print0, print_validation


class Callback:
    """A named point of the loop where code outside the core acts; these do nothing. `name` keys the callback's
    state in the run state (RunState.callbacks): a checkpoint and a rollback carry it, the core never reads it."""

    name = None

    # [(name, documents)] of the data: the ids to leave out, or None
    def documents_to_skip(self, collections):
        return None

    def start(self, parts, report, train_data):  # the run is built (and resumed); the loop begins
        pass

    def skip(self, iteration):  # a reason to draw this iteration's batch and throw it away, or None
        return None

    # it.batches and it.lr may be replaced (fault injection, an LR factor)
    def before_step(self, it):
        pass

    def on_grads(self, model, loss_scale):  # the reduced gradients, before their norm
        pass

    # before any update: 1 apply, 0 veto, in between scale it
    def update_factor(self, loss, grad_norm):
        return 1.0

    def after_update(self):
        pass

    # the step that stands (a replay of a suspect step may replace it)
    def check_step(self, it, step):
        return step

    # the iteration is counted; True: the run was rolled back instead
    def after_step(self, it, step):
        return False

    def after_iteration(self, iteration):  # the iteration is logged, evaluated and saved
        pass

    def close(self):
        pass

    def state_dict(self):  # what checkpoints and snapshots carry for this callback (None: nothing)
        return None

    def load_state_dict(self, state, run, resume):  # state: this callback's own; run: the RunState;
        pass  # resume=False: a rollback (the state goes with the weights, decisions are history)


class Callbacks(Callback):
    """A list of callbacks acting as one, each in the list's order: where the list is built is where the order is
    stated (stability.build_callbacks). A veto from any callback vetoes the step; the first rollback ends the
    iteration for the ones after it."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    def documents_to_skip(self, collections):
        return next(
            (s for c in self.callbacks if (s := c.documents_to_skip(collections)) is not None), None
        )

    def start(self, parts, report, train_data):
        for c in self.callbacks:
            c.start(parts, report, train_data)

    def skip(self, iteration):
        return next((why for c in self.callbacks if (why := c.skip(iteration))), None)

    def before_step(self, it):
        for c in self.callbacks:
            c.before_step(it)

    def on_grads(self, model, loss_scale):
        for c in self.callbacks:
            c.on_grads(model, loss_scale)

    def update_factor(self, loss, grad_norm):
        factor = 1.0
        for c in self.callbacks:
            factor *= c.update_factor(loss, grad_norm)
            if factor == 0:
                return 0.0
        return factor

    def after_update(self):
        for c in self.callbacks:
            c.after_update()

    def check_step(self, it, step):
        for c in self.callbacks:
            step = c.check_step(it, step)
        return step

    def after_step(self, it, step):
        return any(c.after_step(it, step) for c in self.callbacks)  # stops at the first rollback

    def after_iteration(self, iteration):
        for c in self.callbacks:
            c.after_iteration(iteration)

    def close(self):
        for c in reversed(self.callbacks):
            c.close()

    def state_dict(self):
        states = {c.name: c.state_dict() for c in self.callbacks}
        return {name: s for name, s in states.items() if s is not None}

    def load_state_dict(self, states, run, resume):
        for c in self.callbacks:
            c.load_state_dict((states or {}).get(c.name), run, resume)


NO_CALLBACKS = Callbacks()  # a run with no callback: the loop calls these, which do nothing


class StopRun(RuntimeError):
    """Raised by a callback that stops the run on purpose, having saved it (the spike guard at a cap)."""

    exit_code = 1


@dataclass
class Iteration:
    """The iteration the loop is running, as the callbacks see it."""

    number: int
    first_sample: int
    batch_size: int
    seqlen: int
    batches: list = None
    lr: float = 0.0


@dataclass(frozen=True)
class StepRules:
    """What a step and an evaluation read of the run's config, built once where the config is
    whole (builders.step_rules) and handed in: other owners' keys, by their flat names."""

    clip_grad: float  # optim.OptimizerConfig's
    skip_grad_norm_above: float | None
    fp16: bool
    deepspeed: bool
    z_loss: float  # model.GPTConfig's: the model computes it; the step logs it
    packing: object  # loader.packing(cfg): tokens -> the model's inputs for the data flags, or None
    eval_iters: int  # report.LoggingConfig's: the global batches of a validation
    global_batch_size: int  # schedule.ScheduleConfig's
    micro_batch_size: int
    seq_length: int  # model.GPTConfig's: validation runs at the full length


class Step(NamedTuple):
    """An iteration's numbers and its outcome: "ok", or why no update was applied (outcome())."""

    loss: float
    grad_norm: float
    num_zeros: int
    outcome: str
    z_loss: float | None = None  # on logged iterations with z_loss: the interval's mean (report.py)
    replicas: tuple = ()  # every DP replica's (loss, grad norm, ...) (agree()), DP rank 0's first
    norm: object = None  # the grad norm, a tensor on the device: apply_step clips with it (no sync)
    # the loss scale the gradients carry: apply_step unscales by it, not by the scaler's next one
    # (fp16's scaler.update may have grown it since; Megatron unscales with the old scale too)
    loss_scale: float = 1.0


def outcome(skip=None, core=None, factor=1.0):
    """Why an iteration applies no update -- or "ok": the one place the answer is made. Every Step
    carries it (Step.outcome); the run state, the report, the metrics and the callbacks read it.
    In order:
      skip    the whole iteration is skipped, its batch drawn and thrown away (lesson 9): the
              schedule's "skip_train_iteration_range", or a callback's reason (Callback.skip)
      core    the core's own reason (skip_reason): "replicas differ", "nan", "skipped" (an fp16
              overflow, skip_grad_norm_above); None or "ok": none
      factor  the callbacks' update factor (Callback.update_factor): 0 is "vetoed"
    A step a callback replaces (check_step: the guard's replay) carries the replay's, made here."""
    if skip:
        return skip
    if core not in (None, "ok"):
        return core
    return "vetoed" if factor == 0 else "ok"


def skipped_step(reason):
    """The Step of an iteration skipped whole (outcome(skip=reason)): no numbers, no update."""
    return Step(math.nan, math.nan, 0, outcome(skip=reason))


def forward_backward(model, batches, packing, device, loss_scale=1.0, forward_only=False):
    """Mean lm loss over this rank's micro-batches; accumulates (scaled) gradients unless
    forward_only. No host sync: the loss stays a tensor. packing (loader.packing): for Megatron's
    data flags (reset_position_ids, reset_attention_mask, eod_mask_loss), the model's documents,
    positions and loss mask made from each micro-batch's tokens; None: no flag set."""
    if parallel.grid.pp_size > 1:
        return parallel.pipeline_forward_backward(model, batches, loss_scale, forward_only, packing)
    total = torch.zeros((), device=device)
    for x, y in batches:
        loss = model(x, y, **packing(x)) if packing else model(x, y)
        if not forward_only:
            parallel.backward(loss * (loss_scale / len(batches)))
        total += loss.detach()
    return total / len(batches)


def agree(loss, grad_norm, *more, timer=None):
    """Every DP replica's (loss, grad norm, *more) as host floats, DP rank 0's first, the same list on every rank.
    One tensor all-gather over DP on the backend's device, and the step's one host sync: every skip decision is
    then taken from DP rank 0's floats on every replica, which can never split. The DP replicas reduce the same
    gradients: if their numbers differ, one of them is faulty (differ()).
    timer: a report.ComputeTimer whose last reading rides along, each replica's own, never compared."""
    own = [timer.last_seconds(loss.device)] if timer is not None else []
    values = torch.stack([loss.double(), grad_norm.double(), *(m.double() for m in more), *own])
    g = parallel.grid
    if g.dp_size > 1 and g.dp_group is not None:
        gathered = [torch.empty_like(values) for _ in range(g.dp_size)]
        dist.all_gather(gathered, values, group=g.dp_group)
        values = torch.stack(gathered)
    rows = [tuple(r) for r in values.reshape(-1, 2 + len(more) + len(own)).cpu().tolist()]
    if timer is not None:
        timer.gathered([r[-1] for r in rows])
        rows = [r[:-1] for r in rows]
    return tuple(rows)


def differ(replicas):
    """Do the DP replicas' numbers (agree()) differ anywhere, to the last bit?"""
    return len({repr(r) for r in replicas}) > 1


def backward(model, optimizer, scaler, batches, rules, device, timer=None):
    """A step's first half: forward and backward over this rank's micro-batches, the gradients
    reduced over DP (where Callback.on_grads sees them, before train_step measures them). Returns
    the loss averaged over DP, a tensor (no host sync). rules: a StepRules. timer: a
    report.ComputeTimer."""
    optimizer.zero_grad(set_to_none=True)
    buffer = parallel.grad_buffer(model)  # None under DeepSpeed
    if buffer is not None:
        buffer.start(len(batches))
    if timer is not None:
        timer.start(device)
    loss = forward_backward(model, batches, rules.packing, device, loss_scale=scaler.scale)
    if timer is not None:
        timer.stop()
    loss = parallel.average_loss(loss)  # over DP, from the last stage; one process: the loss itself
    if not rules.deepspeed:  # DeepSpeed reduces in its step() (train_step)
        # Wait for the DP all-reduce that backward started, sum the tied embedding's two copies.
        parallel.reduce_gradients(model)
    return loss


def train_step(model, optimizer, scaler, loss, lr, rules, count_zeros=True, timer=None):
    """A step's second half, after backward(): its numbers, nothing applied (apply_step applies
    them). Returns a Step whose outcome is the core's (outcome(): "ok", or why the core applies
    nothing). Under DeepSpeed its step() reduces, measures and applies in one call: the Step is of
    an update applied (or skipped) there. count_zeros: count the zero gradients (a pass over all
    of them: only done for the iterations logged)."""
    if rules.deepspeed:  # DeepSpeed reduces, clips and steps in one call
        loss_value, grad_norm_value, num_zeros, core = optimizer.finish_step(loss.item(), lr)
        return Step(loss_value, grad_norm_value, num_zeros, outcome(core=core))
    grad_norm = parallel.grad_norm(model) / scaler.scale  # the unscaled gradient's, fp32, all of it
    zeros = parallel.count_zeros(model) if count_zeros else torch.zeros((), device=loss.device)
    # logged iterations: the interval's z-loss, averaged over DP (the same on every replica), rides
    # in the sync
    z_loss = count_zeros and rules.z_loss
    logged = [parallel.average_loss(parallel.unwrap(model).pop_z_loss())] if z_loss else []
    # DP rank 0's numbers on every replica (one all-gather, the one host sync): skip decisions
    # cannot split them
    replicas = agree(loss, grad_norm, zeros, *logged, timer=timer)
    loss_value, grad_norm_value, num_zeros, *logged = replicas[0]
    scale = scaler.scale
    if rules.fp16:
        message = scaler.update(overflow=not math.isfinite(grad_norm_value))
        if message:
            print0(message)
    core = skip_reason(rules.skip_grad_norm_above, loss_value, grad_norm_value, replicas)
    return Step(
        loss_value,
        grad_norm_value,
        int(num_zeros),
        outcome(core=core),
        logged[0] if logged else None,
        replicas,
        grad_norm,
        scale,
    )


def apply_step(optimizer, step, lr, rules, factor=1.0):
    """Apply a step the core would apply (train_step's outcome "ok") at learning rate lr, its
    gradients x factor (the callbacks' update_factor: 0 vetoes it, and nothing at all changes).
    Returns the Step that stands, its outcome final (outcome()). Not under DeepSpeed, whose step()
    applied it (train_step)."""
    step = step._replace(outcome=outcome(core=step.outcome, factor=factor))
    if step.outcome != "ok":
        return step
    # fp32 master weights with fp32, unscaled gradients (x factor: unscaled by scale / factor, in
    # the same pass)
    params = optimizer.prepare_grads(step.loss_scale / factor)
    optim.clip_grads(params, rules.clip_grad, step.norm if factor == 1.0 else step.norm * factor)
    optim.set_lr(optimizer, lr)
    optimizer.step()
    return step


def whole_step(
    model,
    optimizer,
    scaler,
    batches,
    lr,
    rules,
    device,
    callbacks=NO_CALLBACKS,
    count_zeros=True,
    timer=None,
):
    """One step, in the one order there is (train.py's loop and every step outside it: a replay, the
    guard's with diagnosis.Veto alone, a tool's, a test's): the step computes, the callbacks decide,
    then the core applies. backward() (the gradients, reduced), the callbacks' on_grads (before the
    norm: an injected fault is measured), train_step() (the numbers, not applied), their
    update_factor (asked only of a step the core would apply, on host floats: no sync of its own),
    apply_step() (x the factor), their after_update (only when it was applied). DeepSpeed's step()
    reduces, measures and applies in one call, with no callback inside (the stability layer refuses
    those that would need one). timer: a report.ComputeTimer timing the forward and backward (its
    reading rides along in agree()), or None."""
    loss = backward(model, optimizer, scaler, batches, rules, device, timer)
    if rules.deepspeed:
        return train_step(model, optimizer, scaler, loss, lr, rules, count_zeros, timer)
    callbacks.on_grads(model, scaler.scale)
    step = train_step(model, optimizer, scaler, loss, lr, rules, count_zeros, timer)
    if step.outcome != "ok":  # the core's own reason: nothing for the callbacks to decide
        return step
    factor = callbacks.update_factor(step.loss, step.grad_norm)
    step = apply_step(optimizer, step, lr, rules, factor)
    if step.outcome == "ok":
        callbacks.after_update()
    return step


def skip_reason(skip_grad_norm_above, loss, grad_norm, replicas):
    """Why the core applies no update (outcome()'s core), or None: on host floats, the same on
    every replica. replicas: every DP replica's numbers (agree())."""
    # a faulty GPU: no update anywhere (the spike guard, when on, retries the step)
    if differ(replicas):
        print0(
            f"warning: the DP replicas computed different loss / grad norm {list(replicas)}: update skipped "
            "(a faulty GPU? spike_guard retries such steps)"
        )
        return "replicas differ"
    if not math.isfinite(loss):
        return "nan"  # a NaN loss never updates the weights
    if not math.isfinite(grad_norm):
        return "skipped"
    if skip_grad_norm_above is not None and grad_norm > skip_grad_norm_above:  # OPT's skipping
        return "skipped"
    return None


@torch.no_grad()
def evaluate(model, dataset, rules, device):
    """Mean loss over the first eval_iters global batches of the validation set, always at full
    seq_length. rules: a StepRules (eval_iters, the batch sizes, seq_length, packing)."""
    model.eval()
    losses, count = [], rules.global_batch_size // (rules.micro_batch_size * parallel.grid.dp_size)
    for i in range(rules.eval_iters):
        first = i * rules.global_batch_size
        batches = loader.micro_batches(
            dataset, first, count, rules.micro_batch_size, rules.seq_length, device
        )
        loss = forward_backward(model, batches, rules.packing, device, forward_only=True)
        losses.append(parallel.average_loss(loss).item())
    model.train()
    return sum(losses) / len(losses)


def evaluate_only(model, valid_data, state, rules, device, split):
    """eval_only: the loaded checkpoint's validation loss and perplexity, on each validation set.
    split: the data's (the message names it when the validation split is empty)."""
    if valid_data is None:
        raise ValueError(
            f"eval_only: no validation data (split {split!r}, eval_iters "
            f"{rules.eval_iters}); give the validation split a share (e.g. --split "
            "0,100,0 for the whole data_path)"
        )
    for name, dataset in loader.validation_sets(valid_data):
        print_validation(evaluate(model, dataset, rules, device), state.iteration, name)
    return state


def print_sample(model, device, tokens, prompt, tokenizer_file, seed):
    """`tokens` tokens (sample_tokens) generated from prompt (sample_prompt; empty: a document's start), top-k 200,
    temperature 0.8, drawn with a generator seeded by seed, when one rank holds the whole model.
    tokenizer_file: the data's."""
    if tokens and parallel.grid.pp_size > 1:
        print0(
            f"no sample printed: with pipeline_model_parallel_size {parallel.grid.pp_size} no "
            "rank holds the whole model; sample from the checkpoint with tools/sample.py"
        )
    elif tokens:
        tok = data.get_tokenizer(tokenizer_file)
        # an empty prompt: from the end-of-document id, a document's start (as tools/sample.py)
        ids = torch.tensor([tok.encode_ordinary(prompt) or [tok.eot_token]], device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        model.eval()
        out = parallel.unwrap(model).generate(
            ids, tokens, temperature=0.8, top_k=200, generator=gen
        )
        print0("-" * 30 + " sample " + "-" * 30 + "\n" + tok.decode(out[0].tolist()))
