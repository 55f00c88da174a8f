"""Pre-train a GPT.

    python train.py                                    # tiny model on bundled Shakespeare, CPU, a few minutes
    python train.py config/gpt2_125m.py --lr=3e-4       # a config file, then --key=value overrides
    torchrun --nproc_per_node 8 train.py config/tr8b_104b.py

One iteration consumes one global batch: micro-batches are accumulated (and pipelined across stages), gradients
are reduced across data-parallel ranks, clipped, and the optimizer steps -- unless the step is skipped (fp16
overflow, NaN loss, skip_grad_norm_above) or the iteration is in skip_train_iteration_range. Every number that
decides what happens next (iteration, consumed samples and tokens, LR and loss-scale state, RNG) is in the
checkpoint, and the sample order is a function of consumed samples only, so a resumed run is bit-exact.
"""
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    import usage  # reads the keys from the source: help prints before torch is imported

    usage.print_help()
    sys.exit(0)

import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

import arguments
import checkpoint
import data
import deepspeed_engine
import estimate
import loader
import optim
import parallel
import reshard
import rng
import safety
import precision
import spike_guard
import telemetry
from model import GPT, GPTConfig


def print0(*args, **kwargs):
    if parallel.grid.rank == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# The shape of the run: batch size, sequence length and length of training, as functions of progress


class Plan:
    """Global batch size (ramp-up), sequence length (curriculum) and when training ends."""

    def __init__(self, cfg, dp_size):
        self.cfg = cfg
        self.rampup = data.RampupBatchSize(cfg.rampup_batch_size, cfg.global_batch_size, cfg.micro_batch_size,
                                           dp_size)
        if cfg.curriculum_learning:
            data.check_curriculum(cfg.min_difficulty, cfg.max_difficulty, cfg.seq_length, cfg.difficulty_step)
        self.skip_ranges = arguments.parse_iteration_ranges(cfg.skip_train_iteration_range)
        self.total_iters, self.total_samples, self.total_tokens = self._simulate()

    def batch_size(self, consumed_samples):
        return self.rampup(consumed_samples)

    def seqlen(self, iteration):
        cfg = self.cfg
        if not cfg.curriculum_learning:
            return cfg.seq_length
        return data.curriculum_seqlen(iteration, cfg.min_difficulty, cfg.max_difficulty, cfg.total_curriculum_step,
                                      cfg.difficulty_step)

    def skipped(self, iteration):
        return any(a <= iteration <= b for a, b in self.skip_ranges)

    def next_key(self, key):
        """The (iteration, first sample, batch size, seqlen) of the next iteration that trains after `key`'s
        (skipped iterations consume their samples unused), None past the end: what loader.Prefetcher loads ahead."""
        iteration, samples = key[0] + 1, key[1] + key[2]
        while self.skipped(iteration):
            iteration, samples = iteration + 1, samples + self.batch_size(samples)
        if iteration > self.total_iters:
            return None
        return iteration, samples, self.batch_size(samples), self.seqlen(iteration)

    def done(self, iteration, samples, tokens):
        cfg = self.cfg
        return ((cfg.train_iters is not None and iteration >= cfg.train_iters)
                or (cfg.train_samples is not None and samples >= cfg.train_samples)
                or (cfg.train_tokens is not None and tokens >= cfg.train_tokens))

    def _simulate(self):
        it = samples = tokens = 0
        while not self.done(it, samples, tokens):
            b = self.batch_size(samples)
            it += 1
            samples, tokens = samples + b, tokens + b * self.seqlen(it)
        return it, samples, tokens


def flops_per_iteration(cfg, padded_vocab, batch, seqlen):
    """Megatron's count (lesson 23): 24 f B s n h^2 (1 + s/6h + V/16nh), f=4 with recomputed activations."""
    f = 4 if cfg.checkpoint_activations else 3
    n, h = cfg.num_layers, cfg.hidden_size
    return 24 * f * batch * seqlen * n * h * h * (1 + seqlen / (6 * h) + padded_vocab / (16 * n * h))


# -----------------------------------------------------------------------------
# Setup


def use_cuda(cfg):
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


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
    with torch.device(device):
        model = GPT(GPTConfig.from_config(cfg), layers, pre_process=g.is_first_stage, post_process=g.is_last_stage)
    model.init_weights(cfg.seed)
    model.to(precision.compute_dtype(cfg))
    if not cfg.deepspeed:
        parallel.attach_grad_buffer(model, precision.grad_dtype(cfg))
    return model


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


def build_scheduler(cfg, plan):
    return optim.AnnealingLR(cfg.lr, cfg.min_lr, cfg.lr_decay_style, warmup_samples=cfg.lr_warmup_samples,
                             decay_samples=cfg.lr_decay_samples or plan.total_samples,
                             warmup_tokens=cfg.lr_warmup_tokens, decay_tokens=cfg.lr_decay_tokens)


def build_scaler(cfg):
    if not cfg.fp16:
        return optim.LossScaler(dynamic=False, static_scale=1.0)
    if cfg.loss_scale is not None:
        return optim.LossScaler(dynamic=False, static_scale=cfg.loss_scale)
    return optim.LossScaler(dynamic=True, initial_scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale,
                            window=cfg.loss_scale_window, hysteresis=cfg.hysteresis)


def check_tokenizer(cfg):
    """A tokenizer_file must have exactly the model's vocabulary: a smaller one wastes rows, a larger one
    produces ids the embedding does not have. (The GPT-2 default is not checked: tests use small vocabularies.)"""
    if cfg.tokenizer_file is None:
        return
    n_vocab = data.get_tokenizer(cfg.tokenizer_file).n_vocab
    if n_vocab != cfg.vocab_size:
        raise ValueError(f"tokenizer_file {cfg.tokenizer_file} has {n_vocab} tokens but vocab_size is "
                         f"{cfg.vocab_size}; set vocab_size={n_vocab} (padding to a multiple is automatic)")


def build_data(cfg, plan):
    data_path = cfg.data_path
    if data_path is None:
        data_path = [data.default_corpus()] if parallel.grid.rank == 0 else None
        if dist.is_initialized():
            box = [data_path]
            dist.broadcast_object_list(box, src=0)
            data_path = box[0]
    evals = plan.total_iters // cfg.eval_interval + 1
    num_samples = (0 if cfg.eval_only else plan.total_samples,
                   cfg.eval_iters * cfg.global_batch_size * (1 if evals else 0), 0)
    check_data(cfg, data_path, num_samples[0])
    # Rank 0 builds and caches the index arrays first; the others then read the cache.
    for builders in (True, False):
        if (parallel.grid.rank == 0) == builders:
            datasets = data.build_datasets(data_path, cfg.split, cfg.seq_length, cfg.seed, num_samples,
                                           cfg.data_cache_dir)
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


def micro_batches(dataset, first_sample, num_micro_batches, cfg, seqlen, device):
    """This DP rank's micro-batches [(inputs, labels)] of the global batch of num_micro_batches * mbs * dp samples
    from first_sample, in Megatron's order (loader.sample_indices), truncated to seqlen (curriculum)."""
    g = parallel.grid
    tokens = loader.load_tokens(dataset, first_sample, num_micro_batches, seqlen, cfg.micro_batch_size, g.dp_rank,
                                g.dp_size, pin_memory=device.type == "cuda")
    return loader.to_device(tokens, device)


def batch_prefetcher(dataset, plan, cfg, device):
    """Loads the micro-batches of the iterations plan.next_key expects on a background thread (loader.py)."""
    g = parallel.grid

    def load(key):
        _, first_sample, _, seqlen = key
        return loader.load_tokens(dataset, first_sample, plan.rampup.num_micro_batches(first_sample), seqlen,
                                  cfg.micro_batch_size, g.dp_rank, g.dp_size, pin_memory=device.type == "cuda")
    return loader.Prefetcher(load, plan.next_key)


# -----------------------------------------------------------------------------
# One training step


def forward_backward(model, batches, cfg, device, loss_scale=1.0, forward_only=False):
    """Mean lm loss over this rank's micro-batches; accumulates (scaled) gradients unless forward_only.
    No host sync: the loss stays a tensor."""
    if parallel.grid.pp_size > 1:
        return parallel.pipeline_forward_backward(model, batches, loss_scale, forward_only)
    total = torch.zeros((), device=device)
    for x, y in batches:
        loss = model(x, y)
        if not forward_only:
            parallel.backward(model, loss * (loss_scale / len(batches)))
        total += loss.detach()
    return total / len(batches)


def train_step(model, optimizer, scaler, batches, lr, cfg, device, count_zeros=True, judge=None, probe=None):
    """Returns (loss, grad_norm, num_zeros, outcome) with outcome one of 'ok', 'skipped', 'nan', 'spike'.
    count_zeros: count the zero gradients (a pass over all of them: only done for the iterations logged).
    judge: the spike guard's judge(loss, grad_norm), a reason to skip the update or None.
    probe: a telemetry.Telemetry recording this step (its grads() and updated() are called here)."""
    optimizer.zero_grad(set_to_none=True)
    buffer = parallel.grad_buffer(model)  # None under DeepSpeed
    if buffer is not None:
        buffer.start(len(batches))
    loss = forward_backward(model, batches, cfg, device, loss_scale=scaler.scale)
    loss = parallel.average_loss(loss)  # over DP, from the last stage; one process: the loss itself
    if cfg.deepspeed:
        return optimizer.finish_step(loss.item(), lr)  # DeepSpeed reduces, clips and steps in one call
    # Wait for the DP all-reduce that backward started, sum the tied embedding's two copies.
    parallel.reduce_gradients(model)
    grad_norm = parallel.grad_norm(model) / scaler.scale  # of the unscaled gradient, fp32, over the whole model
    loss_value, grad_norm_value = (float(v) for v in torch.stack([loss.float(), grad_norm]).cpu())  # one sync
    num_zeros = parallel.count_zeros(model) if count_zeros else 0
    finite = math.isfinite(grad_norm_value)
    if probe is not None:
        probe.grads(scaler.scale)
    if cfg.fp16:
        message = scaler.update(overflow=not finite)
        if message:
            print0(message)
    if not math.isfinite(loss_value):
        return loss_value, grad_norm_value, num_zeros, "nan"  # a NaN loss never updates the weights
    if not finite:
        return loss_value, grad_norm_value, num_zeros, "skipped"
    if cfg.skip_grad_norm_above is not None and grad_norm_value > cfg.skip_grad_norm_above:  # OPT's batch skipping
        return loss_value, grad_norm_value, num_zeros, "skipped"
    if judge is not None and judge(loss_value, grad_norm_value):  # the spike guard skips: nothing at all changes
        return loss_value, grad_norm_value, num_zeros, "spike"
    params = optimizer.prepare_grads(scaler.scale)  # fp32 master weights with fp32, unscaled gradients
    optim.clip_grads(params, cfg.clip_grad, grad_norm)
    optim.set_lr(optimizer, lr)
    optimizer.step()
    if probe is not None:
        probe.updated()
    return loss_value, grad_norm_value, num_zeros, "ok"


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
# Logging


class Logger:
    """Megatron-format lines on stdout; the same scalars to TensorBoard and wandb (offline unless configured)."""

    def __init__(self, cfg):
        self.tb = self.wandb = self.metrics = None
        if parallel.grid.rank != parallel.grid.world_size - 1:  # the last rank has the loss of the last stage
            return
        metrics_dir = cfg.save or cfg.tensorboard_dir  # beside the checkpoints; without them, the TensorBoard logs
        if metrics_dir:
            self.metrics = telemetry.MetricsFile(os.path.join(metrics_dir, "metrics.jsonl"))
        tb_dir = cfg.tensorboard_dir or (os.path.join(cfg.save, "tensorboard") if cfg.save else None)
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(tb_dir)
        mode = os.environ.get("WANDB_MODE", cfg.wandb_mode)
        if cfg.wandb_project and mode != "disabled":
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, mode=mode, config=arguments.to_dict(cfg),
                                    dir=cfg.save or ".")

    def scalars(self, values, step, state):
        """Each scalar against iterations, and in TensorBoard also against consumed samples and tokens (Megatron's
        "lm-loss vs samples"): runs with different batch sizes or a ramp-up compare on those axes."""
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
                self.tb.add_scalar(f"{k} vs samples", v, state["consumed_samples"])
                self.tb.add_scalar(f"{k} vs tokens", v, state["consumed_tokens"])
        if self.wandb:  # wandb has one step axis: the counters go along, to be picked as x axis in its UI
            self.wandb.log({**values, "consumed-samples": state["consumed_samples"],
                            "consumed-tokens": state["consumed_tokens"]}, step=step)

    def record(self, step, values):
        """Into metrics.jsonl only (the log line's scalars by their log names, lists, decisions)."""
        if self.metrics:
            self.metrics.add(step, values)

    def close(self):
        if self.metrics:
            self.metrics.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def log_line(fields):
    """' iteration        5/      20 | consumed samples: ... |' exactly as Megatron-DeepSpeed prints it."""
    return "".join(f" {k}: {v} |" if k != "iteration" else f" iteration {v} |" for k, v in fields)


def print_last_rank(text):
    if parallel.grid.rank == parallel.grid.world_size - 1:
        print(text, flush=True)


def check_tp_replicas(model, optimizer, iteration, resync):
    """Log whether TP-replicated weights still agree across TP ranks (lesson 18); re-sync them if asked."""
    worst, differ = parallel.check_tp_replicas(model, resync=resync, optimizer=optimizer)
    if differ:
        listed = ", ".join(f"{name} ({d:.3e})" for name, d in differ[:8])
        print(f" rank {parallel.grid.rank} (TP rank {parallel.grid.tp_rank}): {len(differ)} replicated "
              f"parameter(s) differ from TP rank 0: {listed}{' ...' if len(differ) > 8 else ''}", flush=True)
    action = " | re-synced from TP rank 0" if resync and worst > 0 else ""
    print0(f" TP replica check at iteration {iteration} | max abs difference from TP rank 0: {worst:.3e}{action} |")


def print_validation(loss, iteration):
    """Megatron's validation block; returns the perplexity."""
    ppl = math.exp(min(20.0, loss))
    line = f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
    print_last_rank("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    return ppl


# -----------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(cfg, state, model, optimizer, scheduler, scaler):
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.save, "before-save", state["iteration"], model)
    run = {"state": dict(state), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
           "config": arguments.to_dict(cfg)}
    rank_state = {"optimizer": optimizer.state_dict(), "rng": checkpoint.rng_state(),
                  # what another layout needs to find this state by parameter name (reshard.py)
                  "param_names": None if cfg.deepspeed else reshard.param_names(model, optimizer)}
    path = checkpoint.save(cfg.save, state["iteration"], parallel._unwrap(model).state_dict(), run, rank_state,
                           write_model_state=parallel.grid.dp_rank == 0)
    print0(f"saved checkpoint at iteration {state['iteration']:8d} to {path}")


def load_checkpoint(cfg, state, model, optimizer, scheduler, scaler):
    """Resume from cfg.load/latest if there is one. Returns True when something was loaded."""
    tag_dir = checkpoint.latest_dir(cfg.load)
    if tag_dir is None:
        print0(f"no checkpoint in {cfg.load}: training from scratch")
        return False
    saved = checkpoint.saved_topology(tag_dir)
    if saved == checkpoint.topology():
        model_state, run, rank_state = checkpoint.load(tag_dir)
    else:  # another TP x PP x DP layout: rebuilt from its slices (reshard.py)
        print0(f"resharding checkpoint {tag_dir}: saved with {reshard.describe(saved)}, now "
               f"{reshard.describe(checkpoint.topology())}")
        need_optimizer = not (cfg.no_load_optim or arguments.reset_warmup_iters(cfg))
        model_state, run, rank_state = reshard.load(tag_dir, saved, model, optimizer, cfg, need_optimizer)
    parallel._unwrap(model).load_state_dict(model_state)  # strict: every parameter of every stage (lesson 11)
    state.update(run["state"])
    scheduler.load_state_dict(run["scheduler"], override=cfg.override_lr_scheduler)
    if cfg.fp16:
        scaler.load_state_dict(run["scaler"])
    warmup, reset_now = arguments.reset_warmup_iters(cfg), False
    if warmup and state.get("optimizer_reset") is None:
        # The chronicles' half-way optimizer reset in one switch (lesson 8): fresh
        # Adam (step 0, zero moments), N iterations at lr=0 to warm the moments up, then the normal schedule.
        # Recorded in the run state, so later resumes keep the lr=0 window and do not reset again.
        state["optimizer_reset"] = {"iteration": state["iteration"], "warmup_iters": warmup}
        reset_now = True
        print0(f"optimizer reset at iteration {state['iteration']}: fresh optimizer, lr=0 for {warmup} iterations")
    elif warmup:
        print0(f"reset_optimizer_warmup_iters ignored: this run's optimizer was already reset at iteration "
               f"{state['optimizer_reset']['iteration']}")
    if cfg.no_load_optim or reset_now:
        print0("optimizer state not loaded: starting from a fresh optimizer (step 0, zero moments)")
        if hasattr(optimizer, "refresh_fp32_params"):  # DeepSpeed's fp32 master copy: from the loaded weights
            optimizer.refresh_fp32_params()
    else:
        optimizer.load_state_dict(rank_state["optimizer"])
    if rank_state["rng"] is None:
        # A resharded checkpoint: a rank's RNG streams do not map onto another layout's ranks. Fresh streams,
        # seeded as at the start of a run (rng.seed: per TP rank and stage) from a seed that differs from it.
        seed = cfg.seed + state["iteration"]
        rng.seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        print0(f"RNG states not restored (the layout changed): fresh streams seeded with seed + iteration = {seed}")
    elif not cfg.no_load_rng:
        checkpoint.set_rng_state(rank_state["rng"])
    print0(f"loaded checkpoint {tag_dir} at iteration {state['iteration']}")
    if cfg.dump_weights:
        checkpoint.dump_weights(cfg.load, "after-load", state["iteration"], model)
    return True


# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    cfg = arguments.load_config(argv)
    if cfg.dry_run:  # sizes the TP x PP x DP layout on the meta device, without starting any process
        estimate.dry_run(cfg)
        return
    grid = parallel.init(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                         backend="nccl" if use_cuda(cfg) else "gloo")
    arguments.validate(cfg, grid.world_size)
    check_tokenizer(cfg)
    # Before anything is built or written: which checkpoint to resume, is it this model, is save ours (lock).
    with safety.RunGuard(cfg) as guard:
        return run(cfg, grid, guard.exit_signal)


def run(cfg, grid, exit_signal):
    """Train (or, with eval_only, evaluate) the configured model; returns the run state. exit_signal() says when
    a SIGTERM asks to save and stop."""
    set_deterministic(cfg)
    device = get_device(cfg)
    rng.seed(cfg.seed)  # the dropout streams of this TP rank and pipeline stage (lesson 22)
    np.random.seed(cfg.seed)

    plan = Plan(cfg, grid.dp_size)
    model = build_model(cfg, device)
    gpt = model.cfg
    print0(f"Model size: {gpt.num_parameters() / 1e9:.3f}B ({gpt.num_parameters():,} parameters; "
           f"{gpt.num_parameters(padded=True):,} with the vocabulary padded to {gpt.padded_vocab_size})")
    print0(f"{grid}; training for {plan.total_iters} iterations, {plan.total_samples:,} samples")
    if grid.pp_size > 1:
        print0(describe_partition(cfg))
    optimizer = build_optimizer(cfg, model)
    if cfg.deepspeed:
        model, optimizer = deepspeed_engine.initialize(cfg, model, optimizer)
    scheduler = build_scheduler(cfg, plan)
    print0(scheduler.describe())
    scaler = build_scaler(cfg)
    train_data, valid_data = build_data(cfg, plan)

    # The LR schedule advances only with applied updates (Megatron steps its scheduler only when the update
    # succeeded: not on fp16 overflows nor on skip_train_iteration_range), hence its own sample/token counters.
    state = {"iteration": 0, "consumed_samples": 0, "consumed_tokens": 0, "scheduler_samples": 0,
             "scheduler_tokens": 0, "optimizer_reset": None, "spike_guard": None}
    if cfg.load:
        load_checkpoint(cfg, state, model, optimizer, scheduler, scaler)
    # Its decisions (skip ranges, LR factor) come back with the run state and hold even with spike_guard off.
    guard, snapshots = spike_guard.SpikeGuard(cfg, state.get("spike_guard")), spike_guard.Snapshots(cfg)
    train_model = torch.compile(model) if cfg.compile else model
    if cfg.eval_only:
        if valid_data is None:
            raise ValueError(f"eval_only: no validation data (split {cfg.split!r}, eval_iters {cfg.eval_iters}); give "
                             "the validation split a share (e.g. --split 0,100,0 for the whole data_path)")
        print_validation(evaluate(train_model, valid_data, cfg, device), state["iteration"])
        return state

    logger = Logger(cfg)
    recorder = telemetry.Telemetry(model, cfg) if cfg.telemetry_interval else None
    job_start = time.time()
    interval = {"time": 0.0, "iters": 0, "loss": 0.0, "steps": 0, "skipped": 0, "nan": 0}
    first_iteration = state["iteration"]
    model.train()
    prefetcher = batch_prefetcher(train_data, plan, cfg, device)
    while not plan.done(state["iteration"], state["consumed_samples"], state["consumed_tokens"]):
        t0 = time.time()
        iteration = state["iteration"] + 1
        batch_size = plan.batch_size(state["consumed_samples"])
        seqlen = plan.seqlen(iteration)
        decision = None
        if guard.skips(iteration):
            print0(f" iteration {iteration:8d}/{plan.total_iters:8d} | skipped (spike guard): "
                   f"samples {state['consumed_samples']}-{state['consumed_samples'] + batch_size - 1} not used |")
            logger.record(iteration, {"skipped": "spike guard"})
        elif plan.skipped(iteration):
            # Drawn and thrown away (no forward/backward/update): later iterations see the batches an unskipped
            # run would see (lesson 9; every range is honoured after any resume).
            print0(f" iteration {iteration:8d}/{plan.total_iters:8d} | skipped (skip_train_iteration_range): "
                   f"samples {state['consumed_samples']}-{state['consumed_samples'] + batch_size - 1} not used |")
            logger.record(iteration, {"skipped": "skip_train_iteration_range"})
        else:
            key = (iteration, state["consumed_samples"], batch_size, seqlen)
            batches = loader.to_device(prefetcher.get(key), device)
            batches = spike_guard.inject_bad_batches(cfg, iteration, batches)
            reset = state["optimizer_reset"]
            in_reset_warmup = reset is not None and iteration <= reset["iteration"] + reset["warmup_iters"]
            lr = 0.0 if in_reset_warmup else scheduler.get_lr(state["scheduler_samples"], state["scheduler_tokens"])
            lr *= guard.lr_scale * spike_guard.injected_lr_factor(cfg, iteration)
            judge = guard.judge if guard.armed(cfg, state) else None
            probe = recorder if recorder and iteration % cfg.telemetry_interval == 0 else None
            if probe:
                probe.begin()
            loss, grad_norm, num_zeros, outcome = train_step(train_model, optimizer, scaler, batches, lr, cfg,
                                                             device, count_zeros=iteration % cfg.log_interval == 0,
                                                             judge=judge, probe=probe)
            if probe:
                stats = probe.finish()
                logger.scalars(telemetry.scalars(stats), iteration, state)
                logger.record(iteration, {"telemetry": stats})
            decision = guard.update(iteration, outcome, loss, grad_norm, scaler)
            if decision is not None:
                decision["samples"] = spike_guard.name_samples(train_model, batches, state["consumed_samples"],
                                                               cfg, train_data, seqlen, iteration)
            if outcome == "ok":
                state["scheduler_samples"] += batch_size
                state["scheduler_tokens"] += batch_size * seqlen
            interval["steps"] += 1
            interval["loss"] += loss if outcome != "nan" else 0.0
            interval["skipped"] += outcome in ("skipped", "spike")
            interval["nan"] += outcome == "nan"
        state["iteration"] = iteration
        state["consumed_samples"] += batch_size
        state["consumed_tokens"] += batch_size * seqlen
        interval["time"] += time.time() - t0
        interval["iters"] += 1
        if decision is not None:
            logger.record(iteration, {"spike guard": [decision]})  # written out later: after the rollback
        if decision is not None and decision["action"] != "skip":
            if snapshots.roll_back(decision, model, optimizer, scheduler, scaler, state, guard) is None \
                    or decision["action"] == "stop":
                state["spike_guard"] = guard.state_dict()
                if cfg.save:
                    save_checkpoint(cfg, state, model, optimizer, scheduler, scaler)
                logger.close()
                raise spike_guard.SpikeGuardStop(decision["line"] + "; saved and stopped: look at the samples "
                                                 "named above, then resume with the caps raised or other settings")
            interval = {k: 0 if isinstance(v, int) else 0.0 for k, v in interval.items()}  # an abandoned timeline
            continue

        if iteration % cfg.log_interval == 0 and interval["steps"]:
            elapsed = interval["time"] / interval["iters"]
            good = interval["steps"] - interval["nan"]
            mean_loss = interval["loss"] / good if good else float("nan")
            tflops = flops_per_iteration(cfg, gpt.padded_vocab_size, batch_size, seqlen) / (
                elapsed * grid.world_size * 1e12)
            fields = [("iteration", f"{iteration:8d}/{plan.total_iters:8d}"),
                      ("consumed samples", f"{state['consumed_samples']:12d}"),
                      ("consumed tokens", f"{state['consumed_tokens']:12d}"),
                      ("elapsed time per iteration (ms)", f"{elapsed * 1000:.1f}"),
                      ("learning rate", f"{lr:.3E}"),
                      ("global batch size", f"{batch_size:5d}")]
            if cfg.curriculum_learning:
                fields.append(("curriculum seqlen", f"{seqlen:5d}"))
            fields.append(("lm loss", f"{mean_loss:.6E}"))
            scalars = {"lm-loss": mean_loss}
            if cfg.z_loss:  # the mean over the interval's micro-batches, apart from the lm loss (lesson 20)
                z_loss = parallel.average_loss(parallel._unwrap(model).pop_z_loss()).item()
                fields.append(("z loss", f"{z_loss:.6E}"))
                scalars["z-loss"] = z_loss
            fields += [("loss scale", f"{scaler.scale:.1f}"),
                       ("grad norm", f"{grad_norm:.3f}"),
                       ("num zeros", f"{float(num_zeros):.1f}"),
                       ("number of skipped iterations", f"{interval['skipped']:3d}"),
                       ("number of nan iterations", f"{interval['nan']:3d}"),
                       ("samples per second", f"{batch_size / elapsed:.3f}"),
                       ("TFLOPs", f"{tflops:.2f}")]
            print_last_rank(log_line(fields))
            logger.record(iteration, telemetry.line_values(fields))
            logger.scalars({**scalars, "learning-rate": lr, "grad-norm": grad_norm,
                            "loss-scale": scaler.scale, "batch-size": batch_size, "seqlen": seqlen,
                            "consumed-tokens": state["consumed_tokens"], "tflops": tflops}, iteration, state)
            interval = {k: 0 if isinstance(v, int) else 0.0 for k, v in interval.items()}

        if cfg.tp_replica_check_interval and iteration % cfg.tp_replica_check_interval == 0 and grid.tp_size > 1:
            check_tp_replicas(model, optimizer, iteration, cfg.tp_replica_resync)

        last = plan.done(iteration, state["consumed_samples"], state["consumed_tokens"])
        if valid_data is not None and cfg.eval_iters > 0 and (iteration % cfg.eval_interval == 0 or last):
            val = evaluate(train_model, valid_data, cfg, device)
            ppl = print_validation(val, iteration)
            logger.scalars({"valid-lm-loss": val, "valid-ppl": ppl}, iteration, state)
            logger.record(iteration, {"validation lm loss": val, "validation ppl": ppl})

        exit_now = (cfg.exit_interval is not None and iteration - first_iteration >= cfg.exit_interval) or (
            cfg.exit_duration_in_mins is not None and _minutes_since(job_start) >= cfg.exit_duration_in_mins)
        signalled = exit_signal()
        exit_now = exit_now or signalled
        if cfg.save and (last or exit_now or (cfg.save_interval and iteration % cfg.save_interval == 0)):
            state["spike_guard"] = guard.state_dict()
            save_checkpoint(cfg, state, model, optimizer, scheduler, scaler)
        snapshots.maybe_take(iteration, model, optimizer, scheduler, scaler, state, guard)
        if exit_now:
            why = "SIGTERM (exit_signal_handler)" if signalled else "exit_interval / exit_duration_in_mins"
            print0(f"exiting at iteration {iteration} ({why})")
            break

    prefetcher.close()
    logger.close()
    if cfg.sample_tokens and grid.pp_size > 1:
        print0(f"no sample printed: with pipeline_model_parallel_size {grid.pp_size} no rank holds the whole model; "
               "sample from the checkpoint with tools/sample.py")
    elif cfg.sample_tokens:
        tok = data.get_tokenizer(cfg.tokenizer_file)
        prompt = torch.tensor([tok.encode_ordinary(cfg.sample_prompt)], device=device)
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        model.eval()
        out = parallel._unwrap(model).generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=200, generator=gen)
        print0("-" * 30 + " sample " + "-" * 30 + "\n" + tok.decode(out[0].tolist()))
    return state


def _minutes_since(start):
    """Elapsed minutes, agreed across ranks (rank 0's clock) so that every rank exits at the same iteration."""
    return parallel.broadcast_scalars([(time.time() - start) / 60.0], src=0)[0]


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except spike_guard.SpikeGuardStop as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(spike_guard.EXIT_CODE)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
