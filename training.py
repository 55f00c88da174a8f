"""One training step, evaluation, and the callbacks the loop calls around them.

    step = train_step(model, optimizer, scaler, batches, lr, cfg, device, callbacks=callbacks)
    loss = evaluate(model, valid_data, cfg, device)
    evaluate_only(model, valid_data, state, cfg, device)  # eval_only: each validation set's loss
    print_sample(cfg, model, device)                      # the run's last word: a sample

A step is forward and backward over this rank's micro-batches (pipelined across stages), the gradients reduced
over data parallelism, clipped and applied -- unless the step is skipped (an fp16 overflow, a NaN loss,
skip_grad_norm_above) or vetoed by a callback. The step has one host sync, agree(): every skip decision is taken
from the same floats on every replica.

The callbacks (Callback) are the named points where code outside the core acts on a run: the stability layer
(stability/) is a list of them. The dependency runs one way: the loop calls these, and knows nothing else of what
is behind them. This file sits below the loop (train.py) and the stability layer, which both build on it.
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

    def documents_to_skip(self, collections):  # [(name, documents)] of the data: the ids to leave out, or None
        return None

    def start(self, parts, report, train_data):  # the run is built (and resumed); the loop begins
        pass

    def skip(self, iteration):  # a reason to draw this iteration's batch and throw it away, or None
        return None

    def before_step(self, it):  # it.batches and it.lr may be replaced (fault injection, an LR factor)
        pass

    def on_grads(self, model, loss_scale):  # the reduced gradients, before their norm
        pass

    def update_factor(self, loss, grad_norm):  # before any update: 1 apply, 0 veto, in between scale it
        return 1.0

    def after_update(self):
        pass

    def check_step(self, it, step):  # the step that stands (a replay of a suspect step may replace it)
        return step

    def after_step(self, it, step):  # the iteration is counted; True: the run was rolled back instead
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
        return next((s for c in self.callbacks if (s := c.documents_to_skip(collections)) is not None), None)

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


class Step(NamedTuple):
    loss: float
    grad_norm: float
    num_zeros: int
    outcome: str  # ok | skipped (fp16 overflow, skip_grad_norm_above) | nan | vetoed (a callback) | replicas differ
    z_loss: float | None = None  # on logged iterations with z_loss: the log interval's mean z-loss (report.py)
    replicas: tuple = ()  # every DP replica's (loss, grad norm, ...) as agree() gathered them, DP rank 0's first


def forward_backward(model, batches, cfg, device, loss_scale=1.0, forward_only=False):
    """Mean lm loss over this rank's micro-batches; accumulates (scaled) gradients unless forward_only.
    No host sync: the loss stays a tensor. Megatron's data flags (reset_position_ids, reset_attention_mask,
    eod_mask_loss): the model's documents, positions and loss mask made from each micro-batch's tokens."""
    packing = loader.packing(cfg)
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


def train_step(model, optimizer, scaler, batches, lr, cfg, device, count_zeros=True, callbacks=NO_CALLBACKS,
               timer=None):
    """One global batch: forward and backward over this rank's micro-batches, gradients reduced, clipped and
    applied at learning rate lr -- unless the step is skipped or vetoed. Returns a Step.
    count_zeros: count the zero gradients (a pass over all of them: only done for the iterations logged).
    callbacks: their on_grads, update_factor and after_update (Callback). timer: a report.ComputeTimer."""
    optimizer.zero_grad(set_to_none=True)
    buffer = parallel.grad_buffer(model)  # None under DeepSpeed
    if buffer is not None:
        buffer.start(len(batches))
    if timer is not None:
        timer.start(device)
    loss = forward_backward(model, batches, cfg, device, loss_scale=scaler.scale)
    if timer is not None:
        timer.stop()
    loss = parallel.average_loss(loss)  # over DP, from the last stage; one process: the loss itself
    if cfg.deepspeed:
        return Step(*optimizer.finish_step(loss.item(), lr))  # DeepSpeed reduces, clips and steps in one call
    # Wait for the DP all-reduce that backward started, sum the tied embedding's two copies.
    parallel.reduce_gradients(model)
    callbacks.on_grads(model, scaler.scale)
    grad_norm = parallel.grad_norm(model) / scaler.scale  # of the unscaled gradient, fp32, over the whole model
    zeros = parallel.count_zeros(model) if count_zeros else torch.zeros((), device=device)
    # logged iterations: the interval's z-loss, averaged over DP (the same on every replica), rides in the sync
    logged = [parallel.average_loss(parallel.unwrap(model).pop_z_loss())] if count_zeros and cfg.z_loss else []
    # DP rank 0's numbers on every replica (one all-gather, the one host sync): skip decisions cannot split them
    replicas = agree(loss, grad_norm, zeros, *logged, timer=timer)
    loss_value, grad_norm_value, num_zeros, *logged = replicas[0]
    numbers = (loss_value, grad_norm_value, int(num_zeros))
    z_loss = logged[0] if logged else None
    if cfg.fp16:
        message = scaler.update(overflow=not math.isfinite(grad_norm_value))
        if message:
            print0(message)
    outcome = skip_reason(cfg, loss_value, grad_norm_value, replicas)
    if outcome is None:
        factor = callbacks.update_factor(loss_value, grad_norm_value)  # host floats: no sync of its own
        if factor == 0:  # vetoed: nothing at all changes
            return Step(*numbers, "vetoed", z_loss, replicas)
        # fp32 master weights with fp32, unscaled gradients (x factor: unscaled by scale / factor, the same pass)
        params = optimizer.prepare_grads(scaler.scale / factor)
        optim.clip_grads(params, cfg.clip_grad, grad_norm if factor == 1.0 else grad_norm * factor)
        optim.set_lr(optimizer, lr)
        optimizer.step()
        callbacks.after_update()
    return Step(*numbers, outcome or "ok", z_loss, replicas)


def skip_reason(cfg, loss, grad_norm, replicas):
    """Why the core applies no update (a Step's outcome), or None: on host floats, the same on every replica.
    replicas: every DP replica's numbers (agree())."""
    if differ(replicas):  # a faulty GPU: no update anywhere (the spike guard, when on, retries the step)
        print0(f"warning: the DP replicas computed different loss / grad norm {list(replicas)}: update skipped "
               "(a faulty GPU? spike_guard retries such steps)")
        return "replicas differ"
    if not math.isfinite(loss):
        return "nan"  # a NaN loss never updates the weights
    if not math.isfinite(grad_norm):
        return "skipped"
    if cfg.skip_grad_norm_above is not None and grad_norm > cfg.skip_grad_norm_above:  # OPT's batch skipping
        return "skipped"
    return None


@torch.no_grad()
def evaluate(model, dataset, cfg, device):
    """Mean loss over the first eval_iters global batches of the validation set, always at full seq_length."""
    model.eval()
    losses, count = [], cfg.global_batch_size // (cfg.micro_batch_size * parallel.grid.dp_size)
    for i in range(cfg.eval_iters):
        batches = loader.micro_batches(dataset, i * cfg.global_batch_size, count,
                                       cfg.micro_batch_size, cfg.seq_length, device)
        losses.append(parallel.average_loss(forward_backward(model, batches, cfg, device, forward_only=True)).item())
    model.train()
    return sum(losses) / len(losses)


def evaluate_only(model, valid_data, state, cfg, device):
    """eval_only: the loaded checkpoint's validation loss and perplexity, on each validation set."""
    if valid_data is None:
        raise ValueError(f"eval_only: no validation data (split {cfg.split!r}, eval_iters "
                         f"{cfg.eval_iters}); give the validation split a share (e.g. --split "
                         "0,100,0 for the whole data_path)")
    for name, dataset in loader.validation_sets(valid_data):
        print_validation(evaluate(model, dataset, cfg, device), state.iteration, name)
    return state


def print_sample(cfg, model, device):
    """sample_tokens tokens generated from sample_prompt (top-k 200, temperature 0.8), when one rank
    holds the whole model."""
    if cfg.sample_tokens and parallel.grid.pp_size > 1:
        print0(f"no sample printed: with pipeline_model_parallel_size {parallel.grid.pp_size} no "
               "rank holds the whole model; sample from the checkpoint with tools/sample.py")
    elif cfg.sample_tokens:
        tok = data.get_tokenizer(cfg.tokenizer_file)
        prompt = torch.tensor([tok.encode_ordinary(cfg.sample_prompt)], device=device)
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        model.eval()
        out = parallel.unwrap(model).generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=200,
                                              generator=gen)
        print0("-" * 30 + " sample " + "-" * 30 + "\n" + tok.decode(out[0].tolist()))
