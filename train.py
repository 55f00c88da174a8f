"""Pre-train a GPT.

    python train.py                                # tiny model on bundled Shakespeare, CPU, minutes
    python train.py config/gpt2_125m.py --lr=3e-4   # a config file, then --key=value overrides
    torchrun --nproc_per_node 8 train.py config/tr8b_104b.py

One iteration consumes one global batch: micro-batches are accumulated (and pipelined across stages),
gradients are reduced across data-parallel ranks, clipped, and the optimizer steps -- unless the
step is skipped (fp16 overflow, NaN loss, skip_grad_norm_above) or the whole iteration is
(skip_train_iteration_range, the spike guard). This file is the loop and its builders; the rules
of the run live beside it:

    schedule.py      batch size, sequence length, skipped iterations, learning rate of an iteration
    run_state.py     the counters; what a checkpoint or a snapshot captures and restores
    report.py        the log line, the validation block, metrics.jsonl, TensorBoard and wandb
    spike_guard.py   what to do about a spiking step; snapshots.py what it rolls back to

Every number that decides what happens next is in the checkpoint, and the sample order is a function
of consumed samples only, so a resumed run is bit-exact.
"""
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    import usage  # reads the keys from the source: help prints before torch is imported

    usage.print_help()
    sys.exit(0)

import json
import math
import os
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import arguments
import checkpoint
import data
import deepspeed_engine
import estimate
import hf
import loader
import optim
import parallel
import precision
import rng
import run_state
import safety
import skip_list
import spike_guard
import telemetry
from model import GPT, GPTConfig
from report import Report, print0, print_validation
from schedule import Schedule
from snapshots import Snapshots


def main(argv=None):
    cfg = arguments.load_config(argv)
    arguments.check_device(cfg)
    if cfg.dry_run:  # sizes the TP x PP x DP layout on the meta device, starting no process
        estimate.dry_run(cfg)
        return
    grid = start(cfg)
    arguments.prepare(cfg, grid.world_size)
    check_tokenizer(cfg)
    # Before anything is built or written: which checkpoint to resume, is it this model, is save ours (lock).
    # The checkpoint writer inside: a save in flight is on disk before the lock is released.
    with safety.RunGuard(cfg) as guard, checkpoint.AsyncWriter(cfg.async_save) as writer:
        return run(cfg, grid, guard.exit_signal, writer)


def start(cfg):
    """The process group, CUDA's allocator configured before it starts (bench.py starts the same way)."""
    use_expandable_segments(cfg)
    return parallel.init(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                         backend="nccl" if use_cuda(cfg) else "gloo", timeout_minutes=cfg.distributed_timeout_minutes)


def run(cfg, grid, exit_signal, writer=None):
    """Train (or, with eval_only, evaluate) the configured model; returns the run state.
    exit_signal() says when a SIGTERM asks to save and stop. writer: the checkpoint.AsyncWriter saves go
    through (None: written synchronously); the caller waits for its last one."""
    device = setup(cfg)
    schedule = Schedule(cfg, grid.dp_size)
    parts = build(cfg, grid, schedule, device)
    train_data, valid_data = build_data(cfg, schedule)
    if cfg.load:
        run_state.load(parts)
    state, guard = parts.state, parts.guard
    if cfg.compile:  # each block one graph, activation checkpointing outside it (model.GPT.compile_blocks)
        parallel.unwrap(parts.model).compile_blocks()
    train_model = parts.model
    if cfg.eval_only:
        if valid_data is None:
            raise ValueError(f"eval_only: no validation data (split {cfg.split!r}, eval_iters "
                             f"{cfg.eval_iters}); give the validation split a share (e.g. --split "
                             "0,100,0 for the whole data_path)")
        print_validation(evaluate(train_model, valid_data, cfg, device), state.iteration)
        return state

    report = Report(cfg, schedule, parts.model)
    snapshots = Snapshots(cfg, parts.model)  # refuses snapshots that would not fit in the node's memory
    recorder = telemetry.Telemetry(parts.model, cfg, parts.optimizer) if cfg.telemetry_interval else None
    first_iteration, job_start = state.iteration, time.time()
    parts.model.train()
    prefetcher = batch_prefetcher(train_data, schedule, cfg, device)
    while not schedule.done(state):
        t0 = time.time()
        iteration, samples = state.iteration + 1, state.consumed_samples
        batch_size, seqlen = schedule.batch_size(samples), schedule.seqlen(iteration)
        step = decision = None
        if guard.skips(iteration) or schedule.skipped(iteration):
            # Drawn and thrown away (no forward, backward or update): later iterations see the
            # batches an unskipped run would see (lesson 9; every range holds after any resume).
            why = "spike guard" if guard.skips(iteration) else "skip_train_iteration_range"
            report.skipped(iteration, state, batch_size, why)
        else:
            batches = loader.to_device(prefetcher.get((iteration, samples, batch_size, seqlen)), device)
            batches = spike_guard.inject_bad_batches(cfg, iteration, batches)
            injected = guard.meets_fault(iteration, schedule.inject_lr_ranges)  # once in time
            lr = schedule.lr_at(iteration, state, guard.lr_scale, inject=injected)
            probe = recorder if recorder and iteration % cfg.telemetry_interval == 0 else None
            if probe:
                probe.begin()
            before = (checkpoint.rng_state(), parts.scaler.state_dict()) if guard.enabled else None
            # fault injection (None outside its iterations): a half-precision cancellation, a weight's bit flip
            numerical = spike_guard.inject_numerical(cfg, iteration, train_model)
            flip_weight = spike_guard.bitflip(cfg, iteration, guard, "weight")
            step = train_step(train_model, parts.optimizer, parts.scaler, batches, lr, cfg, device,
                              count_zeros=iteration % cfg.log_interval == 0,
                              judge=guard.judge if guard.armed(state) else None, probe=probe,
                              fault=spike_guard.bitflip(cfg, iteration, guard, "grad"),
                              trend=soft_skip_trend(cfg, guard))
            if probe:
                stats = probe.finish()
                report.telemetry(iteration, state, stats)
                # the precursor rung (off by default): sees telemetry iterations only; cuts the LR from the next
                warning = spike_guard.precursor_rung(guard, cfg, iteration, stats)
                if warning is not None:
                    report.decision(iteration, warning)
            diagnosis = None
            if guard.enabled and step.outcome in spike_guard.SUSPECT:  # replay it, test its batch (forensics)
                step, diagnosis = spike_guard.investigate(
                    parts, step, iteration, before, snapshots,
                    rerun=lambda judge, scaler=parts.scaler: train_step(train_model, parts.optimizer, scaler,
                                                                        batches, lr, cfg, device, count_zeros=False,
                                                                        judge=judge),
                    forward=lambda: evaluate_batches(train_model, batches, cfg, device))
            if numerical is not None:
                numerical.remove()
            if flip_weight is not None and step.outcome == "ok":
                flip_weight(train_model)
            decision = guard.update(iteration, step.outcome, step.loss, step.grad_norm, parts.scaler, diagnosis,
                                    lr=lr)
            if decision is not None and decision.get("cause") in (None, "data", "optimizer"):  # name the batch
                decision["samples"] = spike_guard.name_samples(train_model, batches, samples, cfg,
                                                               train_data, seqlen, iteration, decision)
            report.step(step, lr)
        state.advance(batch_size, seqlen, applied=step is not None and step.outcome == "ok")
        report.timed(time.time() - t0)
        if decision is not None:
            report.decision(iteration, decision)
        if decision is not None and decision["action"] in ("rollback", "stop"):
            if writer is not None:
                writer.wait()  # a rollback may read the checkpoint being written
            if snapshots.roll_back(decision, parts) is None or decision["action"] == "stop":
                if cfg.save:
                    run_state.save(parts, writer)
                report.close()
                snapshots.close()
                raise spike_guard.SpikeGuardStop(
                    decision["line"] + "; saved and stopped: look at the samples named above, then "
                    "resume with the caps raised or other settings")
            report.restart_interval()  # an abandoned timeline
            continue

        report.log(iteration, state, batch_size, seqlen, parts.scaler.scale)
        if grid.tp_size > 1 and cfg.tp_replica_check_interval \
                and iteration % cfg.tp_replica_check_interval == 0:
            check_tp_replicas(parts.model, parts.optimizer, iteration, cfg.tp_replica_resync)
        last = schedule.done(state)
        if valid_data is not None and cfg.eval_iters > 0 and (last or iteration % cfg.eval_interval == 0):
            report.validation(iteration, state, evaluate(train_model, valid_data, cfg, device))
        why_exit = exit_reason(cfg, iteration - first_iteration, job_start, exit_signal)
        saving = last or why_exit or (cfg.save_interval and iteration % cfg.save_interval == 0)
        if cfg.save and saving:
            run_state.save(parts, writer)
        snapshots.maybe_take(iteration, parts)
        if why_exit:
            print0(f"exiting at iteration {iteration} ({why_exit})")
            break

    prefetcher.close()
    report.close()
    snapshots.close()
    print_sample(cfg, parts.model, device)
    if cfg.deepspeed:
        parts.optimizer.close()  # DeepSpeed's state released before the process groups go (shut_down)
    return state


# -----------------------------------------------------------------------------
# Setup and the builders


def setup(cfg):
    """Determinism, the device and its matmul precision, and the seeds of this TP rank and pipeline stage."""
    set_deterministic(cfg)
    device = get_device(cfg)
    rng.seed(cfg.seed, device)  # the dropout streams of this TP rank and pipeline stage (lesson 22)
    np.random.seed(cfg.seed)
    if device.type == "cuda":
        # tf32: fp32 matmuls on the tensor cores with a 10-bit mantissa (8x the throughput on A100/H100), as
        # Megatron's users run them; only fp32 runs are affected (bf16/fp16 weights multiply in their dtype).
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    return device


def build(cfg, grid, schedule, device):
    """This rank's model, optimizer and loss scaler, the spike guard, a fresh run state: the Parts."""
    model = build_model(cfg, device)
    gpt = model.cfg
    n, padded = gpt.num_parameters(), gpt.num_parameters(padded=True)
    print0(f"Model size: {n / 1e9:.3f}B ({n:,} parameters; {padded:,} with the vocabulary padded to "
           f"{gpt.padded_vocab_size})")
    print0(f"{grid}; training for {schedule.total_iters} iterations, {schedule.total_samples:,} "
           "samples")
    if grid.pp_size > 1:
        print0(describe_partition(cfg))
    optimizer = build_optimizer(cfg, model)
    if cfg.deepspeed:
        model, optimizer = deepspeed_engine.initialize(cfg, model, optimizer)
    print0(schedule.describe())
    # The guard's decisions (skip ranges, LR factor) come back with a checkpoint, even with it off.
    guard = spike_guard.SpikeGuard(cfg)
    return run_state.Parts(cfg, model, optimizer, schedule, build_scaler(cfg), guard)


def use_cuda(cfg):
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def use_expandable_segments(cfg):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set an allocator config: the curriculum
    and ALiBi change the activations' shapes from step to step, which fragments the caching allocator's fixed
    segments (out of memory with memory free). Read by CUDA's allocator when it starts: call before any CUDA
    work."""
    if use_cuda(cfg) and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def set_deterministic(cfg):
    """deterministic=True: the same bits from the same run, whatever the load of the machine. On CPU the matrix
    products are MKL's, whose default code path depends on the number of threads MKL decides to use (1 and 2
    threads give different gradient bits); MKL_CBWR=AUTO,STRICT makes them independent of it. MKL reads it at its
    first call, which train.py makes after this point. torch's own reductions still split by the thread count
    torch starts with: same machine shape, same bits. On CUDA: deterministic cuBLAS workspaces and kernels."""
    if not cfg.deterministic:
        return
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def get_device(cfg):
    """The model's device, which is also the backend's communication device (NCCL for CUDA, gloo for CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda(cfg) else torch.device("cpu")


def build_model(cfg, device):
    """This rank's stage, its weights in the compute dtype (precision.py); on the native path with the GradBuffer
    its gradients accumulate and are all-reduced in (DeepSpeed brings its own)."""
    g = parallel.grid
    layers = parallel.partition_layers(cfg.num_layers, g.pp_size, cfg.pp_partition_method)[g.pp_rank]
    # Allocated on the device directly; the weights are drawn once, on the CPU (GPT.init_weights), for this rank's
    # slice only, and copied in. The ambient device is only where the parameters are allocated.
    with torch.device(device):
        model = GPT(GPTConfig.from_config(cfg), layers, pre_process=g.is_first_stage, post_process=g.is_last_stage,
                    seed=cfg.seed)
    if cfg.init_from_hf:
        init_from_hf(cfg, model)
    model.to(precision.compute_dtype(cfg))
    if not cfg.deepspeed:
        parallel.attach_grad_buffer(model, precision.grad_dtype(cfg))
    return model


def init_from_hf(cfg, model):
    """The weights of the Hugging Face model cfg.init_from_hf (hf.load_into), unless the run resumes: then the
    checkpoint's weights win and the model directory is not read."""
    if cfg.load and checkpoint.latest_dir(cfg.load):
        print0(f"init_from_hf {cfg.init_from_hf} not loaded: resuming from the checkpoint in {cfg.load}, whose "
               "weights win")
        return
    hf.load_into(model, cfg.init_from_hf)
    print0(f"initialised from the Hugging Face model in {cfg.init_from_hf}")


def describe_partition(cfg):
    """'pipeline stages (type:transformer|embedding): 0: embedding + layers 0-4 | 1: layers 5-10 | ...'"""
    parts = []
    pp = cfg.pipeline_model_parallel_size
    for stage, layers in enumerate(parallel.partition_layers(cfg.num_layers, pp, cfg.pp_partition_method)):
        what = [f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"]
        what = what if layers else []
        what = (["embedding"] if stage == 0 else []) + what + (["head"] if stage == pp - 1 else [])
        parts.append(f"{stage}: {' + '.join(what)}")
    return f"pipeline stages ({cfg.pp_partition_method}): " + " | ".join(parts)


def build_optimizer(cfg, model):
    """AdamW (or bitsandbytes') over fp32 master weights (precision.MixedPrecisionOptimizer), sharded over DP with
    zero_stage=1. Under DeepSpeed, the bare optimizer: DeepSpeed keeps the masters and shards them itself."""
    embedding = model.word_embedding_weight()

    def build(params):
        optimizer = optim.build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2,
                                          cfg.adam_eps, use_bnb_optimizer=cfg.use_bnb_optimizer, embedding=embedding,
                                          params=params, independent_decay=cfg.weight_decay_independent)
        return optimizer if cfg.deepspeed else precision.MixedPrecisionOptimizer(optimizer)

    if cfg.deepspeed or cfg.zero_stage == 0 or parallel.grid.dp_size == 1:
        return build(list(model.parameters()))  # not sharded here (under DeepSpeed, deepspeed_engine shards it)
    if cfg.zero_stage != 1:
        raise ValueError(f"zero_stage={cfg.zero_stage} needs deepspeed=True (the native path shards the optimizer "
                         "state only: zero_stage=1)")
    return parallel.ZeroShardedOptimizer(model.parameters(), build)


def build_scaler(cfg):
    if not cfg.fp16:
        return optim.LossScaler(dynamic=False, static_scale=1.0)
    if cfg.loss_scale is not None:
        return optim.LossScaler(dynamic=False, static_scale=cfg.loss_scale)
    return optim.LossScaler(dynamic=True, initial_scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale,
                            window=cfg.loss_scale_window, hysteresis=cfg.hysteresis)


def check_tokenizer(cfg):
    """A tokenizer_file must have the model's vocabulary: a larger one produces ids the embedding does not have, a
    smaller one wastes rows -- except in a model imported with init_from_hf, whose rows are given (BLOOM's
    tokenizer has 250680 tokens, its embedding 250880 rows). (The GPT-2 default is not checked: tests use small
    vocabularies.)"""
    if cfg.tokenizer_file is None:
        return
    n_vocab = data.get_tokenizer(cfg.tokenizer_file).n_vocab
    if n_vocab > cfg.vocab_size:
        raise ValueError(f"tokenizer_file {cfg.tokenizer_file} has {n_vocab} tokens but the model's vocab_size is "
                         f"{cfg.vocab_size}: its ids would not all have an embedding row; "
                         + ("use the tokenizer of the model in init_from_hf" if cfg.init_from_hf else
                            f"set vocab_size={n_vocab} (padding to a multiple is automatic)"))
    if n_vocab < cfg.vocab_size and not cfg.init_from_hf:
        raise ValueError(f"tokenizer_file {cfg.tokenizer_file} has {n_vocab} tokens but vocab_size is "
                         f"{cfg.vocab_size}; set vocab_size={n_vocab} (padding to a multiple is automatic)")


def build_data(cfg, schedule):
    data_path = cfg.data_path
    if data_path is None:
        data_path = [data.default_corpus()] if parallel.grid.rank == 0 else None
        if dist.is_initialized():
            box = [data_path]
            dist.broadcast_object_list(box, src=0)
            data_path = box[0]
    evals = schedule.total_iters // cfg.eval_interval + 1
    num_samples = (0 if cfg.eval_only else schedule.total_samples,
                   cfg.eval_iters * cfg.global_batch_size * (1 if evals else 0), 0)
    check_data(cfg, data_path, num_samples[0])
    prefixes = data.parse_data_path(data_path)[0]
    skips = skip_list.read(cfg.skip_documents, prefixes)[0] if cfg.skip_documents else None
    # Rank 0 builds and caches the index arrays first; the others then read the cache.
    for builders in (True, False):
        if (parallel.grid.rank == 0) == builders:
            datasets = data.build_datasets(data_path, cfg.split, cfg.seq_length, cfg.seed, num_samples,
                                           cfg.data_cache_dir, skips)
        if builders and dist.is_initialized():
            dist.barrier()
    return datasets[0], datasets[1]


def check_data(cfg, data_path, train_samples):
    """Token ids within the vocabulary (else an IndexError mid-run); a warning when the data repeats."""
    prefixes, weights = data.parse_data_path(data_path)
    for prefix, weight in zip(prefixes, weights):
        data.check_token_ids(prefix, cfg.vocab_size)
        epochs = data.train_epochs(prefix, cfg.split, cfg.seq_length, train_samples * weight)
        if epochs > 4:  # Muennighoff et al. 2023: up to ~4 epochs of repeated data cost little, more do
            print0(f"warning: this run goes over the train split of {prefix} {epochs:.1f} times; beyond about 4 "
                   "epochs repeated data stops helping (more data, or a shorter run)")
    if cfg.skip_documents:
        print0(skip_list.summary(cfg.skip_documents, prefixes))


def micro_batches(dataset, first_sample, num_micro_batches, cfg, seqlen, device):
    """This DP rank's micro-batches [(inputs, labels)] of the global batch of num_micro_batches * mbs * dp samples
    from first_sample, in Megatron's order (loader.sample_indices), truncated to seqlen (curriculum)."""
    g = parallel.grid
    tokens = loader.load_tokens(dataset, first_sample, num_micro_batches, seqlen, cfg.micro_batch_size, g.dp_rank,
                                g.dp_size, pin_memory=device.type == "cuda")
    return loader.to_device(tokens, device)


def batch_prefetcher(dataset, schedule, cfg, device):
    """Loads the micro-batches of the iterations schedule.next_key expects on a background thread (loader.py)."""
    g = parallel.grid

    def load(key):
        _, first_sample, _, seqlen = key
        return loader.load_tokens(dataset, first_sample, schedule.rampup.num_micro_batches(first_sample), seqlen,
                                  cfg.micro_batch_size, g.dp_rank, g.dp_size, pin_memory=device.type == "cuda")
    return loader.Prefetcher(load, schedule.next_key)


# -----------------------------------------------------------------------------
# One training step, evaluation


def forward_backward(model, batches, cfg, device, loss_scale=1.0, forward_only=False):
    """Mean lm loss over this rank's micro-batches; accumulates (scaled) gradients unless forward_only.
    No host sync: the loss stays a tensor."""
    if parallel.grid.pp_size > 1:
        return parallel.pipeline_forward_backward(model, batches, loss_scale, forward_only)
    total = torch.zeros((), device=device)
    for x, y in batches:
        loss = model(x, y)
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


def train_step(model, optimizer, scaler, batches, lr, cfg, device, count_zeros=True, judge=None, probe=None,
               fault=None, trend=None):
    """One global batch: forward and backward over this rank's micro-batches, gradients reduced, clipped and
    applied at learning rate lr -- unless the step is skipped. Returns a Step.
    count_zeros: count the zero gradients (a pass over all of them: only done for the iterations logged).
    judge: the spike guard's judge(loss, grad_norm), a reason to skip the update or None.
    probe: a telemetry.Telemetry recording this step (its grads() and updated() are called here).
    fault: fault injection's bit flip (spike_guard.bitflip), called on the reduced gradients.
    trend: the loss's trend (soft_skip_trend): a loss above soft_skip_loss_ratio x it scales the gradients by
    trend / loss before clipping (metaseq's soft skip: the step is taken, with less weight)."""
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
    if fault is not None:
        fault(model)
    grad_norm = parallel.grad_norm(model) / scaler.scale  # of the unscaled gradient, fp32, over the whole model
    zeros = parallel.count_zeros(model) if count_zeros else torch.zeros((), device=device)
    # logged iterations: the interval's z-loss, averaged over DP (the same on every replica), rides in the sync
    logged = [parallel.average_loss(parallel.unwrap(model).pop_z_loss())] if count_zeros and cfg.z_loss else []
    # DP rank 0's numbers on every replica (one all-gather, the one host sync): skip decisions cannot split them
    loss_value, grad_norm_value, num_zeros, *logged, replicas_differ = spike_guard.agreed(loss, grad_norm, zeros,
                                                                                          *logged)
    z_loss = logged[0] if logged else None
    num_zeros = int(num_zeros)
    finite = math.isfinite(grad_norm_value)
    if probe is not None:
        probe.grads(scaler.scale)
    if cfg.fp16:
        message = scaler.update(overflow=not finite)
        if message:
            print0(message)
    if replicas_differ:  # a faulty GPU: no update anywhere, the spike guard retries the step
        return Step(loss_value, grad_norm_value, num_zeros, "replicas differ", z_loss)
    if not math.isfinite(loss_value):
        return Step(loss_value, grad_norm_value, num_zeros, "nan", z_loss)  # a NaN loss never updates the weights
    if not finite:
        return Step(loss_value, grad_norm_value, num_zeros, "skipped", z_loss)
    if cfg.skip_grad_norm_above is not None and grad_norm_value > cfg.skip_grad_norm_above:  # OPT's batch skipping
        return Step(loss_value, grad_norm_value, num_zeros, "skipped", z_loss)
    if judge is not None and judge(loss_value, grad_norm_value):  # the spike guard skips: nothing at all changes
        return Step(loss_value, grad_norm_value, num_zeros, "spike", z_loss)
    shrink = 1.0
    if trend is not None and loss_value > cfg.soft_skip_loss_ratio * trend:  # host floats: no sync of its own
        shrink = trend / loss_value
        print0(f"soft skip: loss {loss_value:.4g} is {loss_value / trend:.2f}x its trend's {trend:.4g}: gradients "
               f"x {shrink:.3g}")
    # fp32 master weights with fp32, unscaled gradients (x shrink: unscaled by scale / shrink, the same pass)
    params = optimizer.prepare_grads(scaler.scale / shrink)
    optim.clip_grads(params, cfg.clip_grad, grad_norm if shrink == 1.0 else grad_norm * shrink)
    optim.set_lr(optimizer, lr)
    optimizer.step()
    if probe is not None:
        probe.updated()
    return Step(loss_value, grad_norm_value, num_zeros, "ok", z_loss)


def soft_skip_trend(cfg, guard):
    """The loss's trend for train_step's soft skip (soft_skip_loss_ratio): the spike guard's line through the last
    applied losses (kept with the guard on or off), once spike_guard_min_steps are recorded; else None."""
    losses = guard.series["loss"]
    if not cfg.soft_skip_loss_ratio or len(losses.values) < cfg.spike_guard_min_steps:
        return None
    trend = losses.expected()
    return trend if trend > 0 else None  # a line through a fast fall can cross zero: no ratio to speak of


@torch.no_grad()
def evaluate_batches(model, batches, cfg, device):
    """The mean loss of these micro-batches, without dropout (the spike guard tests a batch with it)."""
    model.eval()
    loss = parallel.average_loss(forward_backward(model, batches, cfg, device, forward_only=True)).item()
    model.train()
    return loss


@torch.no_grad()
def evaluate(model, dataset, cfg, device):
    """Mean loss over the first eval_iters global batches of the validation set, always at full seq_length."""
    model.eval()
    losses, count = [], cfg.global_batch_size // (cfg.micro_batch_size * parallel.grid.dp_size)
    for i in range(cfg.eval_iters):
        batches = micro_batches(dataset, i * cfg.global_batch_size, count, cfg, cfg.seq_length, device)
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
    """Why this job stops after its `iterations`-th iteration (exit_interval, exit_duration_in_mins, SIGTERM), or
    None. exit_signal() takes part in a collective on every iteration: it is always called."""
    clock = (cfg.exit_interval is not None and iterations >= cfg.exit_interval) or (
        cfg.exit_duration_in_mins is not None and minutes_since(job_start) >= cfg.exit_duration_in_mins)
    if exit_signal():
        return "SIGTERM (exit_signal_handler)"
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


def exit_with(error, code):
    """Stop on a configuration or input error: one clear line, no traceback. Every rank has it (the config is
    everyone's) or some do (a file): rank 0 prints it, and each rank that has it leaves it in torchrun's error file,
    so that the launcher's summary names it as the root cause instead of 'To enable traceback see ...'."""
    line = f"error: {error}"
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun's rank (the process group may not exist yet)
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:  # torch.distributed.elastic's format
            json.dump({"message": {"message": f"{type(error).__name__}: {error}",
                                   "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}, f)
    sys.exit(code)


def shut_down(finished):
    """The process groups last (the prefetch thread, the checkpoint writer and DeepSpeed are done by then), after a
    barrier when the run finished: no rank tears its connections down while another still talks to it (a
    DeepSpeed bf16 PP=2 run that had saved aborted at exit on one rank, 'terminate called without an active
    exception', in 1 of 5 runs, and torchrun called the job failed). After an error there is no barrier: the
    other ranks may be gone."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    # torchrun and SLURM put every rank's stdout on one pipe or file: a line goes out whole, in one write, so that
    # no rank's line lands inside another's. Block buffering splits lines at the buffer's end; unbuffered (torchrun
    # starts its workers with -u) print writes the text and its newline apart, and another rank's line can come
    # between them.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    finished = False
    try:
        main()
        finished = True
    except (ValueError, FileNotFoundError) as e:
        exit_with(e, 2)
    except spike_guard.SpikeGuardStop as e:
        exit_with(e, spike_guard.EXIT_CODE)
    finally:
        shut_down(finished)
