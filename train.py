"""Pre-train a GPT.

    python train.py                                # tiny model on bundled Shakespeare, CPU, minutes
    python train.py config/gpt2_125m.py --lr=3e-4   # a config file, then --key=value overrides
    torchrun --nproc_per_node 8 train.py config/tr8b_104b.py

One iteration consumes one global batch: micro-batches are accumulated (and pipelined across stages),
gradients are reduced across data-parallel ranks, clipped, and the optimizer steps -- unless the
step is skipped (fp16 overflow, NaN loss, skip_grad_norm_above) or the whole iteration is
(skip_train_iteration_range). This file is the loop (`run`) and its step (`train_step`); what each
iteration does is schedule.py's, what is built is model.py's, optim.py's and loader.py's.

The stability layer (stability/: the spike guard, its snapshots, fault injection, telemetry, skip lists,
the soft skip) acts at a few named points of the loop, the methods of `Hooks`; the loop knows nothing
else of it. With no stability switch set it is not even imported: `main` wires it in, nothing else here
names it (tests/test_structure.py keeps it so).

Every number that decides what happens next is in the checkpoint, and the sample order is a function
of consumed samples only, so a resumed run is bit-exact.
"""
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    import usage  # reads the keys from the source: help prints before torch is imported

    usage.print_help()
    sys.exit(0)

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

import arguments
import checkpoint
import cross_entropy
import data
import deepspeed_engine
import launch
import loader
import optim
import parallel
import run_state
import safety
from model import build_model, describe_partition
from report import Report, print0, print_validation
from schedule import Schedule


def main(argv=None):
    cfg = arguments.load_config(argv)
    arguments.check_device(cfg)
    if cfg.dry_run:  # sizes the TP x PP x DP layout on the meta device, starting no process
        import estimate  # it sizes the stability layer's snapshots too: imported for a dry run only
        estimate.dry_run(cfg)
        return
    arguments.prepare(cfg, launch.world_size())  # a config that cannot work stops before any process group
    grid = launch.start(cfg)
    loader.check_tokenizer(cfg)
    # Before anything is built or written: which checkpoint to resume, is it this model, is save ours (lock).
    # The checkpoint writer inside: a save in flight is on disk before the lock is released.
    with safety.RunGuard(cfg) as guard, checkpoint.AsyncWriter(cfg.async_save) as writer:
        from stability import build_hooks  # the one place the core meets the stability layer: it is wired in here
        return run(cfg, grid, guard.exit_signal, writer, build_hooks(cfg, writer, guard.saved_state))


class Hooks:
    """The named points where the stability layer acts (stability/hooks.py implements them; these do nothing).
    The dependency runs one way: the loop calls these, and knows nothing else of what is behind them."""

    def documents_to_skip(self, prefixes):  # the data leaves these documents out (a skip list), or None
        return None

    def start(self, parts, report, train_data):  # the run is built (and resumed); the loop begins
        pass

    def skip(self, iteration):  # a reason to draw this iteration's batch and throw it away, or None
        return None

    def before_step(self, it):  # it.batches and it.lr may be replaced (fault injection, the LR factor)
        pass

    def on_grads(self, model, loss_scale):  # the reduced gradients, before their norm
        pass

    def update_factor(self, loss, grad_norm):  # before any update: 1 apply, 0 skip, in between scale it
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

    def state_dict(self):  # what checkpoints and snapshots carry (the run state's "spike_guard")
        return None

    def load_state_dict(self, state, resume):  # from a run_state.RunState; resume=False: a rollback
        pass


NO_HOOKS = Hooks()  # a run with no stability switch: the loop calls these, which do nothing


@dataclass
class Iteration:
    """The iteration the loop is running, as the hooks see it."""
    number: int
    first_sample: int
    batch_size: int
    seqlen: int
    batches: list = None
    lr: float = 0.0


def run(cfg, grid, exit_signal=lambda: False, writer=None, hooks=None):
    """Train (or, with eval_only, evaluate) the configured model; returns the run state. exit_signal() says when
    a SIGTERM or SIGUSR1 asks to save and stop; writer: the checkpoint.AsyncWriter saves go through (None:
    synchronous)."""
    device, schedule, hooks = launch.setup(cfg), Schedule(cfg, grid.dp_size), hooks or NO_HOOKS
    parts = build(cfg, grid, schedule, device, hooks)
    train_data, valid_data = loader.build_data(cfg, schedule, hooks.documents_to_skip)
    if cfg.load:
        run_state.load(parts)
    if launch.compiles(cfg):  # each block one graph, checkpointing outside it; the loss's elementwise chain fused
        parallel.unwrap(parts.model).compile_blocks()
        cross_entropy.compile_chain()
    model, state = parts.model, parts.state
    if cfg.eval_only:
        return evaluate_only(model, valid_data, state, cfg, device)
    report = Report(cfg, schedule, model)
    hooks.start(parts, report, train_data)
    first_iteration, job_start = state.iteration, time.time()
    model.train()
    prefetcher = loader.batch_prefetcher(train_data, schedule, cfg, device)
    while not schedule.done(state):
        t0, n = time.time(), state.iteration + 1
        it = Iteration(n, state.consumed_samples, schedule.batch_size(state.consumed_samples), schedule.seqlen(n))
        step, skip = None, "skip_train_iteration_range" if schedule.skipped(n) else hooks.skip(n)
        if skip:  # drawn and thrown away: later iterations see the batches an unskipped run sees (lesson 9)
            report.skipped(n, state, it.batch_size, skip)
        else:  # the batch, its learning rate, the step
            it.batches = loader.to_device(prefetcher.get((n, it.first_sample, it.batch_size, it.seqlen)), device)
            it.lr = schedule.lr_at(n, state)
            hooks.before_step(it)
            step = train_step(model, parts.optimizer, parts.scaler, it.batches, it.lr, cfg, device,
                              count_zeros=n % cfg.log_interval == 0, hooks=hooks)
            step = hooks.check_step(it, step)
            report.step(step, it.lr)
        state.advance(it.batch_size, it.seqlen, applied=step is not None and step.outcome == "ok", step=step)
        report.timed(time.time() - t0)
        if step is not None and hooks.after_step(it, step):  # the stability layer rolled the run back
            report.restart_interval()  # an abandoned timeline
            continue
        # log, check the TP replicas (lesson 18), evaluate
        report.log(n, state, it.batch_size, it.seqlen, parts.scaler.scale)
        if grid.tp_size > 1 and cfg.tp_replica_check_interval and n % cfg.tp_replica_check_interval == 0:
            check_tp_replicas(model, parts.optimizer, n, cfg.tp_replica_resync)
        last = schedule.done(state)
        if valid_data is not None and cfg.eval_iters > 0 and (last or n % cfg.eval_interval == 0):
            report.validation(n, state, evaluate(model, valid_data, cfg, device))
        # save, and stop when the job's time is up
        why_exit = exit_reason(cfg, n - first_iteration, job_start, exit_signal)
        if cfg.save and (last or why_exit or (cfg.save_interval and n % cfg.save_interval == 0)):
            run_state.save(parts, writer)
        hooks.after_iteration(n)
        if why_exit:
            print0(f"exiting at iteration {n} ({why_exit})")
            break
    prefetcher.close()
    report.close()
    hooks.close()
    print_sample(cfg, model, device)
    if cfg.deepspeed:
        parts.optimizer.close()  # DeepSpeed's state released before the process groups go (launch.shut_down)
    return state


def build(cfg, grid, schedule, device, hooks=None):
    """This rank's model, optimizer and loss scaler, a fresh run state: the run_state.Parts."""
    model = build_model(cfg, device)
    gpt = model.cfg
    n, padded = gpt.num_parameters(), gpt.num_parameters(padded=True)
    print0(f"Model size: {n / 1e9:.3f}B ({n:,} parameters; {padded:,} with the vocabulary padded to "
           f"{gpt.padded_vocab_size})")
    print0(f"{grid}; training for {schedule.total_iters} iterations, {schedule.total_samples:,} samples")
    if grid.pp_size > 1:
        print0(describe_partition(cfg))
    optimizer = optim.optimizer_for(cfg, model)
    if cfg.deepspeed:
        model, optimizer = deepspeed_engine.initialize(cfg, model, optimizer)
    print0(schedule.describe())
    return run_state.Parts(cfg, model, optimizer, schedule, optim.scaler_for(cfg), hooks or NO_HOOKS)


# -----------------------------------------------------------------------------
# One training step, evaluation


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


class Step(NamedTuple):
    loss: float
    grad_norm: float
    num_zeros: int
    outcome: str  # ok | skipped (fp16 overflow, skip_grad_norm_above) | nan | spike (the guard) | replicas differ
    z_loss: float | None = None  # on logged iterations with z_loss: the log interval's mean z-loss (report.py)


replica_values = []  # [(loss, grad norm, ...)] of every DP replica at the last step (agree())


def agree(loss, grad_norm, *more):
    """(loss, grad norm, *more, replicas differ): the step's numbers as DP rank 0 computed them, on every rank. One
    tensor all-gather over DP on the backend's device, and the step's one host sync: every skip decision is then
    taken from the same floats on every replica, which can never split. The DP replicas reduce the same gradients:
    if their numbers differ, one of them is faulty (every replica's numbers stay in replica_values)."""
    global replica_values
    values = torch.stack([loss.double(), grad_norm.double(), *(m.double() for m in more)])
    g = parallel.grid
    if g.dp_size > 1 and g.dp_group is not None:
        gathered = [torch.empty_like(values) for _ in range(g.dp_size)]
        dist.all_gather(gathered, values, group=g.dp_group)
        values = torch.stack(gathered)
    rows = [tuple(r) for r in values.reshape(-1, 2 + len(more)).cpu().tolist()]
    replica_values = rows
    return (*rows[0], len({repr(r) for r in rows}) > 1)


def train_step(model, optimizer, scaler, batches, lr, cfg, device, count_zeros=True, hooks=NO_HOOKS):
    """One global batch: forward and backward over this rank's micro-batches, gradients reduced, clipped and
    applied at learning rate lr -- unless the step is skipped. Returns a Step.
    count_zeros: count the zero gradients (a pass over all of them: only done for the iterations logged).
    hooks: the stability layer's on_grads, update_factor and after_update (Hooks)."""
    optimizer.zero_grad(set_to_none=True)
    buffer = parallel.grad_buffer(model)  # None under DeepSpeed
    if buffer is not None:
        buffer.start(len(batches))
    loss = forward_backward(model, batches, cfg, device, loss_scale=scaler.scale)
    loss = parallel.average_loss(loss)  # over DP, from the last stage; one process: the loss itself
    if cfg.deepspeed:
        return Step(*optimizer.finish_step(loss.item(), lr))  # DeepSpeed reduces, clips and steps in one call
    # Wait for the DP all-reduce that backward started, sum the tied embedding's two copies.
    parallel.reduce_gradients(model)
    hooks.on_grads(model, scaler.scale)
    grad_norm = parallel.grad_norm(model) / scaler.scale  # of the unscaled gradient, fp32, over the whole model
    zeros = parallel.count_zeros(model) if count_zeros else torch.zeros((), device=device)
    # logged iterations: the interval's z-loss, averaged over DP (the same on every replica), rides in the sync
    logged = [parallel.average_loss(parallel.unwrap(model).pop_z_loss())] if count_zeros and cfg.z_loss else []
    # DP rank 0's numbers on every replica (one all-gather, the one host sync): skip decisions cannot split them
    loss_value, grad_norm_value, num_zeros, *logged, replicas_differ = agree(loss, grad_norm, zeros, *logged)
    z_loss = logged[0] if logged else None
    num_zeros = int(num_zeros)
    finite = math.isfinite(grad_norm_value)
    if cfg.fp16:
        message = scaler.update(overflow=not finite)
        if message:
            print0(message)
    if replicas_differ:  # a faulty GPU: no update anywhere (the spike guard, when on, retries the step)
        print0(f"warning: the DP replicas computed different loss / grad norm {replica_values}: update skipped (a "
               "faulty GPU? spike_guard retries such steps)")
        return Step(loss_value, grad_norm_value, num_zeros, "replicas differ", z_loss)
    if not math.isfinite(loss_value):
        return Step(loss_value, grad_norm_value, num_zeros, "nan", z_loss)  # a NaN loss never updates the weights
    if not finite:
        return Step(loss_value, grad_norm_value, num_zeros, "skipped", z_loss)
    if cfg.skip_grad_norm_above is not None and grad_norm_value > cfg.skip_grad_norm_above:  # OPT's batch skipping
        return Step(loss_value, grad_norm_value, num_zeros, "skipped", z_loss)
    factor = hooks.update_factor(loss_value, grad_norm_value)  # host floats: no sync of its own
    if factor == 0:  # the spike guard skips: nothing at all changes
        return Step(loss_value, grad_norm_value, num_zeros, "spike", z_loss)
    # fp32 master weights with fp32, unscaled gradients (x factor: unscaled by scale / factor, the same pass)
    params = optimizer.prepare_grads(scaler.scale / factor)
    optim.clip_grads(params, cfg.clip_grad, grad_norm if factor == 1.0 else grad_norm * factor)
    optim.set_lr(optimizer, lr)
    optimizer.step()
    hooks.after_update()
    return Step(loss_value, grad_norm_value, num_zeros, "ok", z_loss)


def evaluate_only(model, valid_data, state, cfg, device):
    """eval_only: the validation loss and perplexity of the loaded checkpoint."""
    if valid_data is None:
        raise ValueError(f"eval_only: no validation data (split {cfg.split!r}, eval_iters {cfg.eval_iters}); give "
                         "the validation split a share (e.g. --split 0,100,0 for the whole data_path)")
    print_validation(evaluate(model, valid_data, cfg, device), state.iteration)
    return state


@torch.no_grad()
def evaluate(model, dataset, cfg, device):
    """Mean loss over the first eval_iters global batches of the validation set, always at full seq_length."""
    model.eval()
    losses, count = [], cfg.global_batch_size // (cfg.micro_batch_size * parallel.grid.dp_size)
    for i in range(cfg.eval_iters):
        batches = loader.micro_batches(dataset, i * cfg.global_batch_size, count, cfg, cfg.seq_length, device)
        losses.append(parallel.average_loss(forward_backward(model, batches, cfg, device, forward_only=True)).item())
    model.train()
    return sum(losses) / len(losses)


# -----------------------------------------------------------------------------
# The rest of an iteration, and the end of the run


def check_tp_replicas(model, optimizer, iteration, resync):
    """Log whether TP-replicated weights still agree across TP ranks (lesson 18); re-sync them if asked."""
    worst, differ = parallel.check_tp_replicas(model, resync=resync, optimizer=optimizer)
    if differ:
        listed = ", ".join(f"{name} ({d:.3e})" for name, d in differ[:8])
        print(f" rank {parallel.grid.rank} (TP rank {parallel.grid.tp_rank}): {len(differ)} replicated "
              f"parameter(s) differ from TP rank 0: {listed}{' ...' if len(differ) > 8 else ''}", flush=True)
    action = " | re-synced from TP rank 0" if resync and worst > 0 else ""
    print0(f" TP replica check at iteration {iteration} | max abs difference from TP rank 0: {worst:.3e}{action} |")


def exit_reason(cfg, iterations, job_start, exit_signal):
    """Why this job stops after its `iterations`-th iteration (exit_interval, exit_duration_in_mins, a SIGTERM or
    SIGUSR1), or None. exit_signal() takes part in a collective on every iteration: it is always called."""
    clock = (cfg.exit_interval is not None and iterations >= cfg.exit_interval) or (
        cfg.exit_duration_in_mins is not None and minutes_since(job_start) >= cfg.exit_duration_in_mins)
    signal_name = exit_signal()
    if signal_name:
        return f"{signal_name} (exit_signal_handler)"
    return "exit_interval / exit_duration_in_mins" if clock else None


def minutes_since(start):
    """Elapsed minutes, agreed across ranks (rank 0's clock) so that every rank exits at the same iteration."""
    return parallel.broadcast_scalars([(time.time() - start) / 60.0], src=0)[0]


def print_sample(cfg, model, device):
    """sample_tokens tokens generated from sample_prompt (top-k 200, temperature 0.8), when one rank holds all."""
    if cfg.sample_tokens and parallel.grid.pp_size > 1:
        print0(f"no sample printed: with pipeline_model_parallel_size {parallel.grid.pp_size} no rank holds the "
               "whole model; sample from the checkpoint with tools/sample.py")
    elif cfg.sample_tokens:
        tok = data.get_tokenizer(cfg.tokenizer_file)
        prompt = torch.tensor([tok.encode_ordinary(cfg.sample_prompt)], device=device)
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        model.eval()
        out = parallel.unwrap(model).generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=200, generator=gen)
        print0("-" * 30 + " sample " + "-" * 30 + "\n" + tok.decode(out[0].tolist()))


class StopRun(RuntimeError):
    """Raised by a hook that stops the run on purpose, having saved it (the spike guard at a cap)."""
    exit_code = 1


if __name__ == "__main__":
    # torchrun and SLURM put every rank's stdout on one pipe or file: a line goes out whole, in one write, so that
    # no rank's line lands inside another's. Block buffering splits lines at the buffer's end; unbuffered (torchrun
    # starts its workers with -u) print writes the text and its newline apart, and another rank's line can come
    # between them.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    sys.modules["train"] = sys.modules["__main__"]  # one module: the stability layer's `import train` is this one
    finished = False
    try:
        main()
        finished = True
    except (ValueError, FileNotFoundError) as e:
        launch.exit_with(e, 2)
    except StopRun as e:  # the stability layer gave up (the spike guard's caps): saved, with its message
        launch.exit_with(e, e.exit_code)
    finally:
        launch.shut_down(finished)
