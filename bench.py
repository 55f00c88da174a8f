"""Measure the speed of one training iteration: waiting for data, forward, backward, clipping, optimizer step.

    python bench.py config/gpt2_125m.py                            # a config file, then --key=value overrides
    python bench.py config/tiny.py --hidden_size=384 --bench_steps 20 --bench_warmup 3
    python bench.py --nproc 2 config/tiny.py --pipeline_model_parallel_size=2    # PP2 against one process, CPU
    torchrun --nproc_per_node 8 bench.py config/tr3_1b3.py        # TFLOPs and MFU are per GPU
    python bench.py --table config/gpt2_125m.py config/tr3_1b3.py --use_bundled_corpus \
        --pipeline_model_parallel_size=1 --global_batch_size=16    # one GPU: one table, a process per config

What is timed is what training runs: the model, optimizer and loss scaler come from the builders train.py uses
(builders.py), each iteration is the step train.py takes (training.whole_step), and its batches come
from the training data (data_path, or the bundled corpus) through loader.batch_prefetcher, which
gathers the next iterations' batches on a background thread.
Reported: tokens/s, ms per iteration, achieved TFLOPs by Megatron's formula (the number training logs, with
activation recomputation counted as work), MFU: the model's own FLOPs (6N + attention, no recomputation;
GPTConfig.model_flops_per_iteration) against the device's peak, peak memory (rank 0's), and the data wait: the
time each iteration waited for its batch, as a share of the iteration (next to what loading a batch costs when
nobody prepared it ahead). --table measures several configs in turn, each in a process of its own, and prints one
table of them.

Any config is timed with its schedule set aside (for_timing): the full batch and length at the constant LR cfg.lr,
no warm-up, decay, ramp-up, curriculum or skips; a config whose data is not here is timed on the bundled corpus;
fp16 from a loss scale at which steps update (TIMING_LOSS_SCALE, then the warm-up until one does). Each says so in
one line.

Costs (--step_costs, on by default): one more iteration after the timed ones runs under torch.profiler (CPU ops,
and CUDA kernels on a GPU) and its time is split into shares (COSTS): the output layer with its loss, attention,
the other matmuls, elementwise and other ops, the optimizer (grad norm, clipping, step), gradient accumulation
and reduction, the data wait, and "other": what no op accounts for (Python, launches, host syncs, idle GPU).
On a GPU the line also gives the share of the iteration in which the GPU ran nothing (no kernel or copy on any
stream), which tells a step that the host cannot keep fed from one whose time goes to kernels that no share names
(inductor's fused ones land in "other").
Each op's own time (kernel time on a GPU) goes to one share, by the ranges that the step's parts are wrapped
in for that iteration (costs_named) or by the op's name (cost_of). The profiler slows the small ops a little,
so compare shares, not milliseconds, with the timed iterations.

--nproc N starts N gloo processes on this machine (torch.multiprocessing; TP and PP sizes from the config, DP
the rest) and, before them, one process on the same global and micro-batch size, and prints both step times
and the speed-up. The N processes get cores/N threads each, the single one all of them. With PP > 1 it also
prints the pipeline bubble of each stage: the time the stage spends in parallel.communicate (waiting for its
sends and receives: mostly waiting for the neighbour, the copy itself is small on one machine) as a share of
its time in parallel.pipeline_forward_backward (host seconds on the CPU, CUDA events on a GPU), against the ideal
(p-1)/(m+p-1) of 1F1B with equal stages and free messages. Unequal stages (on CPU the last one's output layer
dominates) add to it.

On a shared machine other processes move these numbers a lot: compare runs taken back to back, alternating,
and look at the best iteration as well as the mean.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import arguments
import builders
import cross_entropy
import data
import files
import launch
import loader
import optim
import parallel
import report as report_module
import run_state
import schedule
import training
from builders import build_model
from model import GPTConfig
from report import print0
from sections import section
from stability import telemetry

# The GPUs' nominal peaks (report.GPU_PEAKS, what the training log's MFU divides by too)
GPU_PEAKS, gpu_peaks = report_module.GPU_PEAKS, report_module.gpu_peaks


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_peak(device, dtype, n, repeats=10):
    """Best-of-`repeats` FLOP/s of an n x n x n matmul: what this device really does when nothing else gets in
    the way (on a CPU it depends on the cores and threads given, so it is measured, not looked up)."""
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    a @ b  # warm-up: thread pools, cuBLAS handles
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak(device, dtype):
    """(peak FLOP/s, where the number comes from); dtype is what the matmuls of training run in (CPU only)."""
    if device.type == "cuda":
        name, peaks = (
            torch.cuda.get_device_name(device),
            gpu_peaks(torch.cuda.get_device_name(device)),
        )
        if peaks is not None:
            return peaks[0] * 1e12, f"{name}, bf16 dense peak from the datasheet"
        return measured_peak(device, torch.bfloat16, 8192), f"{name}, measured bf16 8192^3 matmul"
    name = str(dtype).removeprefix("torch.")
    return measured_peak(
        device, dtype, 2048
    ), f"CPU, {torch.get_num_threads()} threads, measured {name} 2048^3 matmul"


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # ru_maxrss is in KiB on Linux; it covers the whole process (Python, torch's libraries), not just tensors
    return resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss * 1024, "peak RSS of the whole process"


def parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--bench_steps", "--bench-steps", type=int, default=10, help="timed iterations"
    )
    parser.add_argument(
        "--bench_warmup",
        "--bench-warmup",
        type=int,
        default=2,
        help="untimed iterations first (allocator, thread pools, torch.compile, optimizer state)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="gloo processes to start here (CPU), compared with one process on the same batch",
    )
    parser.add_argument(
        "--step_costs",
        "--step-costs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one more iteration and split its time into shares (output layer, attention, ...)",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="measure each CONFIG.py given, each in a process of its own, then print one table",
    )
    parser.add_argument(
        "--guard_price",
        "--guard-price",
        action="store_true",
        help="time CONFIG.py with --spike_guard at its defaults against without, "
        "each in a process of its own, and print the ratio of their tokens/s",
    )
    parser.add_argument(
        "--result_json",
        "--result-json",
        metavar="PATH",
        help="also write rank 0's numbers to PATH as JSON (what --table reads from each process)",
    )
    # the rest is CONFIG.py --key=value ..., exactly as train.py takes it
    bench, rest = parser.parse_known_args(argv)
    if bench.bench_steps < 1 or bench.bench_warmup < 0:
        raise ValueError(
            f"--bench_steps={bench.bench_steps} --bench_warmup={bench.bench_warmup}: time at least one "
            "iteration, after zero or more warm-up ones"
        )
    return bench, rest


# A config's schedule changes a step's shape or LR from one iteration to the next (ramp-up, curriculum, skipped
# iterations, warm-up and decay), and some of it refuses a run of a few iterations (a warm-up longer than the run,
# a ramp-up counted in samples beside train_iters, an optimizer reset without a checkpoint). None of it is part of
# what a step costs: bench times every iteration at the full batch and length, at the constant LR cfg.lr.
SCHEDULE_KEYS = (
    "lr_warmup_samples",
    "lr_warmup_tokens",
    "lr_decay_samples",
    "lr_decay_tokens",
    "lr_decay_style",
    "lr_wsd_decay_samples",
    "lr_wsd_decay_style",
    "rampup_batch_size",
    "curriculum_learning",
    "skip_train_iteration_range",
    "reset_optimizer_warmup_iters",
)
# fp16 with a dynamic loss scale: timing starts from at most this scale (torch.amp.GradScaler's first one), not from
# Megatron's default initial_loss_scale of 2^32, at which every step overflows and is skipped, its optimizer never
# run. The warm-up then goes on while a step overflows, the scale backing off as in training (at most
# SETTLE_ITERATIONS more), so that the timed steps are steps that update.
TIMING_LOSS_SCALE = 2.0**16
SETTLE_ITERATIONS = 32


def for_timing(cfg, given, iterations):
    """Make cfg a run of `iterations` iterations of one shape at a constant LR (SCHEDULE_KEYS), on data that is
    there, with the model's weights drawn (not imported). given: the keys set on the command line. The config's
    own values are only set aside here, never written back. Returns the lines that say what was set aside."""
    steady = {key: arguments.FIELDS[key].default for key in SCHEDULE_KEYS} | {
        "lr_decay_style": "constant"
    }
    aside = {key: getattr(cfg, key) for key, value in steady.items() if getattr(cfg, key) != value}
    for key, value in steady.items():
        setattr(cfg, key, value)
    cfg.train_iters, cfg.train_samples, cfg.train_tokens = iterations, None, None
    cfg.eval_iters = 0  # no validation set to build
    notes = [
        f"bench: timing at a constant LR = {cfg.lr:g}, every iteration at the full batch and length: the "
        "config's warm-up/decay/ramp-up/curriculum/skips are not part of a step's cost"
        + (f" (set aside: {', '.join(f'{k}={v!r}' for k, v in aside.items())})" if aside else "")
    ]
    data_note = bundled_instead(cfg, given)
    if data_note:
        notes.append(data_note)
    # the model's keys came from its config.json already (arguments.from_hf)
    if cfg.init_from_hf is not None:
        notes.append(
            f"bench: the model's shape from {cfg.init_from_hf}, its weights drawn, not imported: their values "
            "are not part of a step's cost"
        )
        cfg.init_from_hf = None
    return notes


def bundled_instead(cfg, given):
    """Time on the bundled corpus where the config names no data that is here (most config files set no
    data_path, tr11_176b's names BLOOM's corpus): the tokens' values are not part of a step's cost. A data_path
    given on the command line is used as given, and --use_bundled_corpus there replaces the config file's data.
    Returns the line that says so, or None."""
    if cfg.data_source != "megatron" or "data_path" in given:
        return None
    if "use_bundled_corpus" in given and cfg.use_bundled_corpus:
        cfg.data_path, cfg.tokenizer_file = None, None  # the bundled corpus is GPT-2's tokens
        return None
    if cfg.data_path is None:
        if cfg.use_bundled_corpus:
            return None
        why = f"{cfg.config_file} sets no data_path"
    else:
        prefixes = data.parse_data_path(cfg.data_path)[0]
        if all(os.path.exists(p + ".bin") and os.path.exists(p + ".idx") for p in prefixes):
            return None
        why = f"{cfg.config_file}'s data_path {' '.join(cfg.data_path)} is not here"
    cfg.data_path, cfg.use_bundled_corpus, cfg.tokenizer_file = None, True, None
    return (
        f"bench: {why}: timing on the bundled corpus (the tokens' values are not part of a step's cost; "
        "--data_path=PREFIX times loading yours)"
    )


# bench's MFU on a CPU, for the up-front estimate: 4.4-6.1% measured on 2 shared cores (gpt2_125m's
# widths at 1 layer, 2 x 128 tokens, bf16; and at 64 wide, fp32), n = 4; the 50304-way output layer,
# the optimizer and the elementwise ops keep it far below the matmul rate
CPU_MFU = 0.05


def cpu_cost_note(cfg, iterations, device, processes=1):
    """The line that says what the iterations will cost on this CPU, before any is run: the model
    FLOPs of each (this process's share) at CPU_MFU of a quick matmul's rate here."""
    gpt = section(GPTConfig, cfg)
    flops = gpt.model_flops_per_iteration(cfg.global_batch_size, cfg.seq_length) / processes
    dtype = matmul_dtype(cfg)
    rate = measured_peak(device, dtype, 1024, repeats=3)
    seconds = iterations * flops / (CPU_MFU * rate)
    return (
        f"bench: on the CPU, {iterations} iteration(s) of {flops / 1e9:,.1f} GFLOP (the "
        f"model's) at {rate / 1e9:,.1f} GFLOP/s ({str(dtype)[6:]} 1024^3 matmul here): about "
        f"{seconds:,.0f} s at the ~{100 * CPU_MFU:.0f}% MFU bench measures on a CPU, after "
        "start-up (imports, build, the data's index: 15-30 s on 2 cores); --hidden_size, "
        "--num_layers and --bf16=false cut it"
    )


@dataclasses.dataclass
class Run:
    """What bench times, built as train.py builds it."""

    cfg: arguments.Config
    grid: parallel.Grid
    device: torch.device
    model: torch.nn.Module
    optimizer: object
    scaler: optim.LossScaler
    plan: schedule.Schedule
    train_data: object
    recorder: object  # telemetry.Telemetry with telemetry_interval, else None
    local_params: int  # parameters on this rank
    scale_note: str | None  # where fp16's loss scale starts from, when bench changed it
    rules: training.StepRules  # what a step reads of cfg (builders.step_rules)
    parts: object = None  # run_state.Parts with the stability layer's callbacks (--spike_guard ...)


def set_up(bench, argv):
    """Load the config, make it a steady run of the iterations bench needs (for_timing) and build it."""
    cfg = arguments.load_config(argv)
    arguments.check_device(cfg)
    # as train.py: the allocator's expandable segments, the process group
    layout_cfg = section(parallel.LayoutConfig, cfg)
    grid = launch.start(layout_cfg, cfg.tensor_model_parallel_size, cfg.save)
    settle = SETTLE_ITERATIONS if cfg.fp16 and cfg.loss_scale is None else 0
    iterations = bench.bench_warmup + settle + bench.bench_steps + (1 if bench.step_costs else 0)
    notes = for_timing(cfg, arguments.parse_cli(argv)[1], iterations)
    arguments.prepare(cfg, grid.world_size)
    # as train.py: determinism, seeds, TF32 for fp32 matmuls on CUDA
    device = launch.setup(layout_cfg, cfg.seed)
    if device.type == "cpu":  # a config's real widths take minutes here: said before they are spent
        notes.append(cpu_cost_note(cfg, iterations, device, grid.world_size))
    for note in notes:
        print0(note)

    model = build_model(cfg, device)
    local_params = sum(p.numel() for p in model.parameters())
    optimizer = builders.build_optimizer(cfg, model)
    if cfg.deepspeed:
        model, optimizer = builders.build_deepspeed(cfg, model, optimizer)
    scaler = optim.scaler_for(cfg)
    scale_note = None
    if scaler.dynamic and scaler.scale > TIMING_LOSS_SCALE:
        scale_note = (
            f"the config's initial_loss_scale {scaler.scale:.0f} capped at {TIMING_LOSS_SCALE:.0f}"
        )
        scaler.scale = max(TIMING_LOSS_SCALE, scaler.min_scale)
    if launch.compiles(layout_cfg):  # as train.py: on CUDA unless --compile=false
        parallel.unwrap(model).compile_blocks()
        cross_entropy.compile_chain()
    model.train()
    plan = schedule.Schedule(section(schedule.ScheduleConfig, cfg), grid.dp_size, cfg.seq_length)
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    train_data, _ = loader.build_data(data_cfg, context, plan)
    # as train.py; with --spike_guard its callbacks record telemetry (with_callbacks)
    recorder = (
        telemetry.Telemetry(model, cfg, optimizer)
        if cfg.telemetry_interval and not cfg.spike_guard
        else None
    )
    rules = builders.step_rules(cfg)
    parts = with_callbacks(cfg, model, optimizer, plan, scaler, train_data, rules)
    return Run(
        cfg,
        grid,
        device,
        model,
        optimizer,
        scaler,
        plan,
        train_data,
        recorder,
        local_params,
        scale_note,
        rules,
        parts,
    )


def with_callbacks(cfg, model, optimizer, plan, scaler, train_data, rules):
    """With --spike_guard (what --guard_price times): the stability layer's callbacks as train.py
    builds and starts them (telemetry's too, when telemetry_interval asks), on a run state of their
    own; else None, and bench times its own telemetry probe as before. Their report writes no file
    (no save, TensorBoard or wandb: bench's iterations are not a run's)."""
    if not cfg.spike_guard:
        return None
    callbacks = builders.build_callbacks(cfg)
    quiet = dataclasses.replace(cfg, save=None, tensorboard_dir=None, wandb_project=None)
    parts = run_state.Parts(cfg, model, optimizer, plan, scaler, callbacks, rules)
    log_cfg = section(report_module.LoggingConfig, quiet)
    callbacks.start(parts, report_module.Report(log_cfg, plan, model), train_data)
    return parts


def iterate(run, prefetcher, key, probe=None):
    """One training iteration as train.py runs it: (wall seconds, CPU seconds, seconds waiting for the batch, the
    training.Step). probe: a telemetry.Telemetry that records this iteration. The zero count (a pass over every
    gradient, for the log) on the iterations train.py logs, every log_interval-th, as train.py."""
    sync(run.device)
    t0, c0 = time.perf_counter(), time.process_time()
    batches = loader.to_device(prefetcher.get(key), run.device)
    t_data = time.perf_counter() - t0
    if run.parts is not None:  # the loop's callbacks around the step, as train.py calls them
        step = guarded_step(run, key, batches)
        sync(run.device)
        return time.perf_counter() - t0, time.process_time() - c0, t_data, step
    if probe:
        probe.begin()
    callbacks = telemetry.Probe(probe) if probe else training.NO_CALLBACKS
    step = training.whole_step(
        run.model,
        run.optimizer,
        run.scaler,
        batches,
        run.cfg.lr,
        run.rules,
        run.device,
        callbacks,
        logged(run, key),
    )
    if probe:
        probe.finish()
    sync(run.device)
    return time.perf_counter() - t0, time.process_time() - c0, t_data, step


def guarded_step(run, key, batches):
    """One step with the stability layer's callbacks at each of train.py's points (their skip and a
    rollback are not acted on: bench times steps, and a timed step that is rolled back still cost
    its time)."""
    callbacks, state = run.parts.callbacks, run.parts.state
    it = training.Iteration(key[0], key[1], key[2], key[3], batches, run.cfg.lr)
    callbacks.before_step(it)
    step = training.whole_step(
        run.model,
        run.optimizer,
        run.scaler,
        it.batches,
        it.lr,
        run.rules,
        run.device,
        callbacks,
        logged(run, key),
    )
    step = callbacks.check_step(it, step)
    state.advance(it.batch_size, it.seqlen, applied=step.outcome == "ok", step=step)
    callbacks.after_step(it, step)
    callbacks.after_iteration(it.number)
    return step


def logged(run, key):
    """Does train.py log iteration key[0] (and count its zero gradients for the log)?"""
    return key[0] % run.cfg.log_interval == 0


@dataclasses.dataclass
class Timings:
    """The timed iterations. With telemetry_interval, every interval-th one records telemetry, as in training:
    timed apart, so that its cost can be stated per step (interleaved steps share the machine's noise); CPU time
    too, the steadier measure on a shared machine."""

    # wall seconds of the iterations without telemetry
    times: list = dataclasses.field(default_factory=list)
    probed: list = dataclasses.field(default_factory=list)  # of those recording telemetry
    # CPU seconds: {recording: [...]}
    cpu: dict = dataclasses.field(default_factory=lambda: {False: [], True: []})
    waits: list = dataclasses.field(default_factory=list)  # seconds each waited for its batch
    # steps that applied no update (an fp16 overflow, a NaN): their optimizer was not timed
    skipped: int = 0
    warmup: int = 0  # untimed iterations before them
    warmup_skipped: int = 0
    loss_scale: float = 1.0  # at the first timed iteration

    def steady(self):
        """The wall seconds a step is measured by: the iterations without telemetry, or with telemetry_interval=1,
        where every iteration records it, those."""
        return self.times or self.probed


def warm_up(run, bench, prefetcher, key, timings):
    """The untimed iterations: bench_warmup of them, then under fp16's dynamic loss scale more while the last one
    did not update (the scale backs off on each overflow), SETTLE_ITERATIONS at most; after overflows the scale is
    halved once more, since the first one at which a step updates is at the edge of overflowing and would skip some
    of the timed steps. Returns the next key."""
    settle = SETTLE_ITERATIONS if run.cfg.fp16 and run.scaler.dynamic else 0
    updated = not settle
    while timings.warmup < bench.bench_warmup or (
        not updated and timings.warmup < bench.bench_warmup + settle
    ):
        updated = iterate(run, prefetcher, key)[3].outcome == "ok"
        timings.warmup, timings.warmup_skipped = (
            timings.warmup + 1,
            timings.warmup_skipped + (not updated),
        )
        key = run.plan.next_key(key)
    if settle and timings.warmup_skipped:
        run.scaler.scale = max(run.scaler.scale / 2, run.scaler.min_scale)
    timings.loss_scale = run.scaler.scale
    return key


def time_steps(run, bench, prefetcher, key, timings):
    """The timed iterations, after the pipeline's counters and the peak memory are reset. Returns the next key."""
    parallel.pipeline_seconds.update(schedule=0.0, communicate=0.0)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
        # the host does not wait there
        parallel.pipeline_events = {"schedule": [], "communicate": []}
    interval = run.cfg.telemetry_interval
    for n in range(bench.bench_steps):
        probe = run.recorder if run.recorder and (n + 1) % interval == 0 else None
        wall, cpu, wait, step = iterate(run, prefetcher, key, probe)
        (timings.probed if probe else timings.times).append(wall)
        timings.cpu[probe is not None].append(cpu)
        timings.waits.append(wait)
        timings.skipped += step.outcome != "ok"
        key = run.plan.next_key(key)
    return key


def profile_step(run, prefetcher, key):
    """step_costs of one more iteration, kept out of the pipeline's times, which are of the timed iterations."""
    seconds, events, parallel.pipeline_events = (
        dict(parallel.pipeline_seconds),
        parallel.pipeline_events,
        None,
    )
    costs = step_costs(
        lambda: loader.to_device(prefetcher.get(key), run.device),
        lambda batches: training.whole_step(
            run.model,
            run.optimizer,
            run.scaler,
            batches,
            run.cfg.lr,
            run.rules,
            run.device,
            count_zeros=logged(run, key),
        ),
        run.optimizer,
        run.device,
    )
    parallel.pipeline_seconds.update(seconds)
    parallel.pipeline_events = events
    return costs


def unprepared_load_seconds(run):
    """What loading a global batch costs when nobody prepared it ahead."""
    cfg, grid = run.cfg, run.grid
    t0 = time.perf_counter()
    count = cfg.global_batch_size // (cfg.micro_batch_size * grid.dp_size)
    loader.micro_batches(run.train_data, 0, count, cfg.micro_batch_size, cfg.seq_length, run.device)
    sync(run.device)
    return time.perf_counter() - t0


def pipeline_stages(grid):
    """[(seconds in communicate, seconds in the 1F1B schedule)] of each stage over the timed iterations, every
    rank's gathered for rank 0's report."""
    seconds = dict(parallel.pipeline_seconds)
    # CUDA: the stream's time between the events, after a sync
    if parallel.pipeline_events is not None:
        seconds = {
            kind: sum(a.elapsed_time(b) for a, b in pairs) / 1000
            for kind, pairs in parallel.pipeline_events.items()
        }
        parallel.pipeline_events = None
    mine = (grid.pp_rank, seconds["communicate"], seconds["schedule"])
    stages = [mine]
    if dist.is_initialized():
        stages = [None] * grid.world_size
        dist.all_gather_object(stages, mine)
    return [next((c, p) for r, c, p in stages if r == stage) for stage in range(grid.pp_size)]


def measure(argv):
    """Build, warm up and time one configuration; print its report on rank 0 and return its numbers there."""
    bench, rest = parse(argv)
    run = set_up(bench, rest)
    timings, key = Timings(), (1, 0, run.cfg.global_batch_size, run.cfg.seq_length)
    with loader.batch_prefetcher(run.train_data, run.plan, run.device) as prefetcher:
        key = warm_up(run, bench, prefetcher, key, timings)
        key = time_steps(run, bench, prefetcher, key, timings)
        costs = profile_step(run, prefetcher, key) if bench.step_costs else None
    load = unprepared_load_seconds(run)
    stages = pipeline_stages(run.grid)
    if run.grid.rank != 0:
        return None
    result = numbers(run, timings, stages, costs)
    report(run, bench, timings, result, load)
    return result


def numbers(run, timings, stages, costs):
    """Rank 0's numbers of the timed iterations: what report prints and --table tabulates."""
    cfg, grid, gpt = run.cfg, run.grid, parallel.unwrap(run.model).config
    B, T = cfg.global_batch_size, cfg.seq_length
    times = timings.steady()
    mean, best = statistics.mean(times), min(times)
    # per GPU, as training logs (lesson 23)
    tflops = gpt.flops_per_iteration(B, T) / (mean * grid.world_size * 1e12)
    # without recomputation
    model_tflops = gpt.model_flops_per_iteration(B, T) / (mean * grid.world_size * 1e12)
    memory, memory_source = peak_memory(run.device)
    peak, peak_source = device_peak(run.device, matmul_dtype(cfg))
    wait_share = sum(timings.waits) / (sum(timings.times) + sum(timings.probed))
    result = {
        "mean": mean,
        "best": best,
        "wait_share": wait_share,
        "layout": repr(grid),
        "stages": stages,
        "tokens/s": B * T / mean,
        "TFLOPs": tflops,
        "model TFLOPs": model_tflops,
        "MFU": model_tflops * 1e12 / peak,
        "peak": peak,
        "peak_source": peak_source,
        "memory": memory,
        "memory_source": memory_source,
        "micro_batches": B // (cfg.micro_batch_size * grid.dp_size),
        "pp": grid.pp_size,
        "costs": costs,
        "skipped": timings.skipped,
        "loss_scale": timings.loss_scale,
        "warmup_skipped": timings.warmup_skipped,
        "steps": len(times),
        "iterations": timings.warmup + len(timings.times) + len(timings.probed),
    }
    if grid.pp_size > 1:
        result["bubble"] = [comm / pipe for comm, pipe in stages]
    return result


def matmul_dtype(cfg):
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32


def report(run, bench, timings, r, load):
    """Print rank 0's report of one configuration."""
    cfg, grid, device, gpt = run.cfg, run.grid, run.device, parallel.unwrap(run.model).config
    B, T, times = cfg.global_batch_size, cfg.seq_length, timings.steady()
    print(
        f"model:        {gpt.num_parameters():,} parameters ({gpt.num_parameters(padded=True):,} with the vocabulary "
        f"padded to {gpt.padded_vocab_size}; {run.local_params:,} on this rank); {grid}\n"
        f"run:          {str(matmul_dtype(cfg)).removeprefix('torch.')}, global batch {B} x {T} tokens (micro-batch "
        f"{cfg.micro_batch_size}), {bench.bench_steps} timed iterations after {timings.warmup} warm-up, "
        f"{device}, {torch.get_num_threads()} threads\n"
        f"tokens/s:     {r['tokens/s']:,.1f} (best iteration {B * T / r['best']:,.1f})\n"
        f"ms/iteration: {r['mean'] * 1000:.1f} (best {r['best'] * 1000:.1f}, stdev "
        f"{statistics.pstdev(times) * 1000:.1f})\n"
        f"TFLOPs:       {r['TFLOPs']:.4g} per {'GPU' if device.type == 'cuda' else 'process'} (Megatron's formula, "
        f"recomputation included)\n"
        f"MFU:          {100 * r['MFU']:.1f}% of {r['peak'] / 1e12:.4g} TFLOP/s ({r['peak_source']}): the "
        f"model's FLOPs alone, {r['model TFLOPs']:.4g} TFLOPs (6N + attention, no recomputation)\n"
        f"peak memory:  {r['memory'] / 2**20:,.0f} MiB ({r['memory_source']})\n"
        f"data wait:    {100 * r['wait_share']:.3f}% of the iteration ({1000 * statistics.mean(timings.waits):.2f} "
        f"ms; loading a batch not prepared ahead takes {1000 * load:.2f} ms)",
        flush=True,
    )
    if cfg.fp16 or timings.skipped:
        print(f"loss scale:   {loss_scale_line(run, timings)}", flush=True)
    if r["costs"]:
        print(f"costs:        {costs_line(r['costs'])} of one profiled iteration", flush=True)
    if timings.probed:
        print_telemetry(timings)
    if grid.pp_size > 1:
        ideal = (grid.pp_size - 1) / (r["micro_batches"] + grid.pp_size - 1)
        print(
            "bubble:       "
            + ", ".join(f"stage {p} waits {100 * b:.1f}%" for p, b in enumerate(r["bubble"]))
            + f" of its forward-backward; ideal (p-1)/(m+p-1) = {100 * ideal:.1f}% (p={grid.pp_size}, "
            f"m={r['micro_batches']})",
            flush=True,
        )


def loss_scale_line(run, timings):
    """fp16: where the timed iterations' loss scale came from; any precision: the timed steps that did not update."""
    skipped = (
        f"{timings.skipped} of {len(timings.times) + len(timings.probed)} timed iterations applied no update "
        "(their optimizer step not run)"
    )
    if not run.cfg.fp16:
        return skipped
    if not run.scaler.dynamic:
        return f"{timings.loss_scale:.10g}, static (loss_scale); {skipped}"
    start = run.scale_note or "the config's initial_loss_scale"
    return (
        f"{timings.loss_scale:.10g} at the first timed iteration (dynamic, from {start}; "
        f"{timings.warmup_skipped} of {timings.warmup} warm-up iterations did not update"
        f"{', then halved once more' if timings.warmup_skipped else ''}); {skipped}"
    )


def print_telemetry(timings):
    """What recording telemetry adds to a step, in wall and CPU time."""
    if not timings.times:
        print(
            "telemetry:    recorded at every timed iteration (telemetry_interval=1): the times above include it; "
            "a telemetry_interval of 2 or more times steps without it too",
            flush=True,
        )
        return
    for what, plain, recording in (
        ("wall", timings.times, timings.probed),
        ("CPU", timings.cpu[False], timings.cpu[True]),
    ):
        plain, recording = statistics.median(plain), statistics.median(recording)
        print(
            f"telemetry:    {what} {recording * 1000:.1f} ms per recording step vs {plain * 1000:.1f} ms "
            f"(medians of {len(timings.probed)} and {len(timings.times)}): +{100 * (recording / plain - 1):.1f}% "
            f"per recording step, +{10 * (recording / plain - 1):.2f}% at telemetry_interval=10",
            flush=True,
        )


# -----------------------------------------------------------------------------
# Where one iteration's time goes: one profiled iteration, its ops' time in shares

COSTS = (
    "output layer + loss",
    "attention",
    "other matmuls",
    "elementwise and other ops",
    "optimizer",
    "gradient accumulation / reduction",
    "data wait",
    "other",
)
MATMULS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_addmm_activation",
}
# Ranges around the parts of the step (training.py) that an op's name cannot place (an add_ is an
# add_), set for the profiled iteration by costs_named. Gradient accumulation's own: autograd's
# AccumulateGrad, where parallel.GradBuffer's hook adds each .grad into its bucket and starts the DP
# all-reduce.
RANGES = {
    "bench: data wait": "data wait",
    "bench: optimizer": "optimizer",
    "Optimizer.step#": "optimizer",
    "bench: gradient reduction": "gradient accumulation / reduction",
    "torch::autograd::AccumulateGrad": "gradient accumulation / reduction",
}


def cost_of(chain):
    """The share (one of COSTS) an op's own time goes to, from the names of its enclosing ranges and ops, outermost
    first: the ranges above, then the loss's autograd Function (cross_entropy.LinearCrossEntropy: the output
    layer's matmuls and the loss's elementwise chain, forward and backward), attention (scaled_dot_product_*:
    flash, memory-efficient or the CPU kernel, and their backward), the matmuls, and any other op."""
    for name in chain:
        for prefix, cost in RANGES.items():
            if name.startswith(prefix):
                return cost
    if any("CrossEntropy" in name for name in chain):
        return "output layer + loss"
    if any("scaled_dot_product" in name.lower() or "ScaledDotProduct" in name for name in chain):
        return "attention"
    if any(name in MATMULS or "MmBackward" in name for name in chain):
        return "other matmuls"
    if any(name.startswith(("aten::", "triton_", "autograd::engine")) for name in chain):
        return "elementwise and other ops"
    return "other"


@contextlib.contextmanager
def costs_named(optimizer):
    """For the profiled iteration: the optimizer's part of the step (training.py: zero_grad, the
    grad norm and the count of zeros, unscaling, clipping, the step; DeepSpeed's finish_step) and
    the wait for the DP all-reduce (parallel.reduce_gradients) run inside named ranges; undone on
    the way out."""
    undo = []

    def name(owner, attribute, label):
        original = getattr(owner, attribute, None)
        if original is None:
            return

        def named(*args, **kwargs):
            with record_function(label):
                return original(*args, **kwargs)

        undo.append((owner, attribute, vars(owner).get(attribute, None), attribute in vars(owner)))
        setattr(owner, attribute, named)

    for attribute in ("zero_grad", "prepare_grads", "step", "finish_step"):
        name(optimizer, attribute, "bench: optimizer")
    for owner, attribute in (
        (parallel, "grad_norm"),
        (parallel, "count_zeros"),
        (optim, "clip_grads"),
    ):
        name(owner, attribute, "bench: optimizer")
    name(parallel, "reduce_gradients", "bench: gradient reduction")
    try:
        yield
    finally:
        for owner, attribute, original, had in reversed(undo):
            if had:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)


def step_costs(fetch, run, optimizer, device, clock=time.perf_counter):
    """{cost: share of the iteration} (COSTS, summing to 1) of one iteration: batches = fetch(), run(batches),
    under torch.profiler. Each op's own time goes to cost_of its chain of ranges; on a GPU its kernels' time
    (what the GPU spent on it), on the CPU its host time on this thread (the prefetch thread's is not the
    step's). The data wait is the host's wait for the batch, by `clock` as the iteration's wall time is. "other":
    the iteration's wall time that no op accounts for; when the ops add up to more (kernels on overlapping
    streams: NCCL's beside the compute's), the shares are of their sum and "other" is 0."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with costs_named(optimizer), profile(activities=activities) as prof:
        sync(device)
        t0 = clock()
        with record_function("bench: step"):
            with record_function("bench: data wait"):
                batches = fetch()
            fetched = clock()
            run(batches)
        sync(device)
        end = clock()
    events = prof.events()
    spent = op_times(events, cuda)
    spent["data wait"] = (fetched - t0) * 1e6  # microseconds, the profiler's unit
    wall = (end - t0) * 1e6
    costs = shares(spent, wall)
    if cuda:  # a step the host cannot keep fed shows as idle GPU time (the first GPU run's 16 x 1024 gpt2_125m)
        costs["GPU idle"] = max(0.0, wall - gpu_busy(events)) / max(wall, sum(spent.values()))
    return costs


def gpu_busy(events):
    """Microseconds in which the GPU ran a kernel or a copy on some stream: the union of the device events'
    intervals, overlapping streams counted once; the ranges' GPU-side copies (user annotations, named as the
    host's ranges) left out, since they span idle time too."""
    ranges = {
        e.name
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.is_user_annotation
    }
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU
        and not e.is_user_annotation
        and e.name not in ranges
    )
    busy, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def op_times(events, cuda):
    """{cost: microseconds} of the ops of one profiled iteration (the data wait's own ops left out: the wait is
    measured whole). The host's events only: ops and ranges (a kernel's time is its launching op's
    self_device_time_total; the kernels' own events and the ranges' GPU-side copies would count it again)."""
    events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    main = next(e for e in events if e.name == "bench: step")
    spent = dict.fromkeys(COSTS, 0.0)
    for e in events:
        if e.name in ("bench: step", "bench: data wait") or not (cuda or e.thread == main.thread):
            continue
        chain, parent = [e.name], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        cost = cost_of(chain[::-1])
        if cost != "data wait":
            spent[cost] += e.self_device_time_total if cuda else e.self_cpu_time_total
    return spent


def shares(spent, wall):
    """{cost: share}: `spent` (microseconds by cost, "other" left out) over the wall time, "other" the rest."""
    spent = dict(spent, other=0.0)
    total = max(wall, sum(spent.values()))
    spent["other"] = total - sum(spent.values())
    return {cost: t / total for cost, t in spent.items()}


def costs_line(costs):
    line = ", ".join(f"{cost} {100 * costs[cost]:.1f}%" for cost in COSTS)
    # not a share beside the others: time in which the GPU waited, whatever the host did
    if "GPU idle" in costs:
        line += f"; the GPU idle {100 * costs['GPU idle']:.1f}% (no kernel or copy on any stream)"
    return line


def _worker(rank, nproc, port, argv, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
    )
    # the cores shared out, not oversubscribed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        result = measure(argv)
        if rank == 0:
            results.put(result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def table(argv):
    """Each configuration measured in a process of its own, one after the other, then a row each: what a GPU's note
    quotes. Apart, nothing one row compiled or allocated is there for the next (torch.compile would recompile the
    second's blocks for dynamic shapes), and a row that fails prints its error while the others still print.
    Returns [(config, numbers or the error)]."""
    configs = [a for a in argv if a.endswith(".py")]
    others = [
        a
        for a in argv
        if not a.endswith(".py")
        and a != "--table"
        and not a.startswith("--result_json")
        and not a.startswith("--result-json")
    ]
    rows = [(name, measure_apart(name, others)) for name in configs]
    print(
        "\n| config | tokens/s | TFLOPs (Megatron) | MFU (model FLOPs) | peak memory |\n"
        "| --- | ---: | ---: | ---: | ---: |"
    )
    for name, r in rows:
        print(row(name, r))
    costed = [(name, r["costs"]) for name, r in rows if isinstance(r, dict) and r["costs"]]
    if costed:  # where each config's iteration goes: what to make faster first
        print("\n| config | " + " | ".join(COSTS) + " |\n| --- |" + " ---: |" * len(COSTS))
        for name, costs in costed:
            print(
                f"| {config_name(name)} | "
                + " | ".join(f"{100 * costs[c]:.1f}%" for c in COSTS)
                + " |"
            )
    sys.stdout.flush()
    return rows


def guard_price(argv):
    """--guard_price: the config without the stability layer, then with --spike_guard at its
    defaults, each in a process of its own (measure_apart); prints their tokens/s and the ratio.
    Returns the rows as table()."""
    configs = [a for a in argv if a.endswith(".py")]
    if len(configs) != 1 or any(a.startswith("--spike_guard") for a in argv):
        raise ValueError(
            "--guard_price times one CONFIG.py, with --spike_guard at its defaults "
            "against without: give one config file and no --spike_guard* key"
        )
    others = [
        a
        for a in argv
        if not a.endswith(".py")
        and a not in ("--guard_price", "--guard-price")
        and not a.startswith(("--result_json", "--result-json"))
    ]
    rows = [
        (configs[0], measure_apart(configs[0], others)),
        (configs[0] + " --spike_guard", measure_apart(configs[0], others + ["--spike_guard"])),
    ]
    (_, plain), (_, guarded) = rows
    name = config_name(configs[0])
    if isinstance(plain, str) or isinstance(guarded, str):
        failed = plain if isinstance(plain, str) else guarded
        print(f"guard: {name}: no ratio, a run failed: {failed}", flush=True)
        return rows
    cfg = arguments.load_config([configs[0], *parse(others)[1]])
    iterations, interval = guarded["iterations"], cfg.spike_guard_snapshot_interval
    snapshots = (
        f"snapshots every {interval} iterations: none in these {iterations}, their cost "
        "not in the ratio"
        if iterations < interval
        else f"snapshots every {interval} iterations included"
    )
    if iterations < cfg.spike_guard_min_steps:  # unarmed: no noise measure, no unseen forwards
        snapshots += (
            f"; the guard arms after {cfg.spike_guard_min_steps} steps: unarmed in "
            "these, its checks' forwards not in the ratio"
        )
    print(
        f"guard: {name} {guarded['tokens/s']:,.1f} tokens/s with --spike_guard at its defaults, "
        f"{plain['tokens/s']:,.1f} without: ratio {guarded['tokens/s'] / plain['tokens/s']:.3f} "
        f"(means of {guarded['steps']} timed iterations each, a process each; {snapshots}; "
        "goal >= 0.99)",
        flush=True,
    )
    return rows


def config_name(path):
    return os.path.basename(path).removesuffix(".py")


def row(name, r):
    """The table's row of one configuration: its numbers, or its error (a str)."""
    if isinstance(r, str):
        return f"| {config_name(name)} | failed: {r} | | | |"
    return (
        f"| {config_name(name)} | {r['tokens/s']:,.0f} | {r['TFLOPs']:.1f} | {100 * r['MFU']:.1f}% | "
        f"{r['memory'] / 2**30:.1f} GiB |"
    )


def measure_apart(config, others):
    """bench.py on one configuration in a process of its own (its report printed as it goes, its error output
    passed on): rank 0's numbers, or its error, the last line it wrote there, when it failed."""
    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), config, *others, f"--result_json={path}"],
            stderr=subprocess.PIPE,
            text=True,
        )
        sys.stderr.write(done.stderr)
        if done.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no error message"]
    return f"exit code {done.returncode}: {last[0].strip()}"


# keys every result of numbers() has: an existing --result_json holding them is bench's own, written over on a rerun
RESULT_KEYS = {"tokens/s", "TFLOPs", "MFU", "layout", "mean", "best"}


def check_result_json(path):
    """Refuse, before the measurement, a --result_json the numbers could not be written to (lost after the whole
    measurement otherwise), or an existing file that is not bench's numbers (bench writes over nothing it did not
    write)."""
    files.check_output_file(
        path,
        "--result_json",
        "bench.json",
        (
            lambda p: files.json_holds(p, RESULT_KEYS),
            "bench's numbers",
            "bench writes over its own results only",
        ),
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench, rest = parse(argv)
    if bench.table:
        return table(argv)
    if bench.guard_price:
        return guard_price(argv)
    if bench.result_json:
        check_result_json(bench.result_json)
    result = measure(argv) if bench.nproc <= 1 else compare(bench, rest, argv)
    if bench.result_json and result is not None:
        files.write_text(json.dumps(result), bench.result_json)
    return result


def compare(bench, rest, argv):
    """--nproc N: one process, then N gloo processes on the same global batch; returns the N processes' numbers."""
    print("-- 1 process, the same global batch", flush=True)
    single = measure(
        rest
        + [
            "--tensor_model_parallel_size=1",
            "--pipeline_model_parallel_size=1",
            f"--bench_steps={bench.bench_steps}",
            f"--bench_warmup={bench.bench_warmup}",
        ]
    )
    print(f"-- {bench.nproc} processes", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(
        _worker,
        args=(bench.nproc, parallel.free_port(), argv, results),
        nprocs=bench.nproc,
        start_method="spawn",
    )
    multi = results.get()
    print(
        f"-- {multi['layout']} against 1 process: {multi['best'] * 1000:.0f} vs {single['best'] * 1000:.0f} ms "
        f"per iteration (best), {single['best'] / multi['best']:.2f}x the throughput "
        f"(means {multi['mean'] * 1000:.0f} vs {single['mean'] * 1000:.0f} ms: "
        f"{single['mean'] / multi['mean']:.2f}x)"
    )
    return multi


if __name__ == "__main__":
    try:
        rows = main()
        if isinstance(rows, list) and any(isinstance(r, str) for _, r in rows):
            sys.exit(1)  # --table, --guard_price: a row failed (its error is in the table)
    except ValueError as e:  # configuration errors: one clear line, as train.py
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
