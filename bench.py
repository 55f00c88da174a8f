"""Measure the speed of one training iteration: waiting for data, forward, backward, clipping, optimizer step.

    python bench.py config/gpt2_125m.py                            # a config file, then --key=value overrides
    python bench.py config/tiny.py --hidden_size=384 --bench_steps 20 --bench_warmup 3
    python bench.py --nproc 2 config/tiny.py --pipeline_model_parallel_size=2    # PP2 against one process, CPU
    torchrun --nproc_per_node 8 bench.py config/tr3_1b3.py        # TFLOPs and MFU are per GPU
    python bench.py --table config/gpt2_125m.py config/tr3_1b3.py --use_bundled_corpus \
        --pipeline_model_parallel_size=1 --global_batch_size=16    # one GPU: one table of both

What is timed is what training runs: the model, optimizer and loss scaler come from the builders train.py uses
(builders.py), each iteration is training.train_step, and its batches come from the training data (data_path,
or the bundled corpus) through loader.batch_prefetcher, which gathers the next iterations' batches on a background
thread.
Reported: tokens/s, ms per iteration, achieved TFLOPs by Megatron's formula (the number training logs, with
activation recomputation counted as work), MFU: the model's own FLOPs (6N + attention, no recomputation;
GPTConfig.model_flops_per_iteration) against the device's peak, peak memory (rank 0's), and the data wait: the
time each iteration waited for its batch, as a share of the iteration (next to what loading a batch costs when
nobody prepared it ahead). --table measures several configs in turn and prints one table of them.

Costs (--step_costs, on by default): one more iteration after the timed ones runs under torch.profiler (CPU ops,
and CUDA kernels on a GPU) and its time is split into shares (COSTS): the output layer with its loss, attention,
the other matmuls, elementwise and other ops, the optimizer (grad norm, clipping, step), gradient accumulation
and reduction, the data wait, and "other": what no op accounts for (Python, launches, host syncs, idle GPU).
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
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import arguments
import cross_entropy
import deepspeed_engine
import launch
import loader
import optim
import parallel
import schedule
import training
from builders import build_model
from report import print0
from stability import telemetry

# Dense bf16 tensor-core peaks (no sparsity) of the SXM parts, TFLOP/s. PCIe cards are slower (H100 PCIe: 756),
# so on one of those the MFU printed here is an underestimate.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_peak(device, dtype, n, repeats=10):
    """Best-of-`repeats` FLOP/s of an n x n x n matmul: what this device really does when nothing else gets in
    the way (on a CPU it depends on the cores and threads given, so it is measured, not looked up)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
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
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name}, bf16 dense peak from the datasheet"
        return measured_peak(device, torch.bfloat16, 8192), f"{name}, measured bf16 8192^3 matmul"
    name = str(dtype).removeprefix("torch.")
    return measured_peak(device, dtype, 2048), f"CPU, {torch.get_num_threads()} threads, measured {name} 2048^3 matmul"


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # ru_maxrss is in KiB on Linux; it covers the whole process (Python, torch's libraries), not just tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of the whole process"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--bench_steps", "--bench-steps", type=int, default=10, help="timed iterations")
    parser.add_argument("--bench_warmup", "--bench-warmup", type=int, default=2,
                        help="untimed iterations first (allocator, thread pools, torch.compile, optimizer state)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="gloo processes to start here (CPU), compared with one process on the same batch")
    parser.add_argument("--step_costs", "--step-costs", action=argparse.BooleanOptionalAction, default=True,
                        help="profile one more iteration and split its time into shares (output layer, attention, ...)")
    parser.add_argument("--table", action="store_true",
                        help="measure each CONFIG.py given in turn (the overrides apply to all), then print one table")
    return parser.parse_known_args(argv)  # the rest is CONFIG.py --key=value ..., exactly as train.py takes it


def measure(argv):
    """Build, warm up and time one configuration; print its report on rank 0 and return its numbers there."""
    bench, rest = parse(argv)
    cfg = arguments.load_config(rest)
    arguments.check_device(cfg)
    grid = launch.start(cfg)  # as train.py: the allocator's expandable segments, the process group
    if cfg.rampup_batch_size is not None:
        print0("bench: rampup_batch_size ignored, every iteration uses global_batch_size")
        cfg.rampup_batch_size = None
    profiled = 1 if bench.step_costs else 0  # one more iteration, under the profiler
    cfg.train_iters, cfg.train_samples, cfg.train_tokens = bench.bench_warmup + bench.bench_steps + profiled, None, None
    cfg.curriculum_learning, cfg.eval_iters = False, 0  # full-length batches; no validation set to build
    arguments.prepare(cfg, grid.world_size)
    device = launch.setup(cfg)  # as train.py: determinism, seeds, TF32 for fp32 matmuls on CUDA

    model = build_model(cfg, device)
    gpt, local_params = model.cfg, sum(p.numel() for p in model.parameters())
    optimizer = optim.optimizer_for(cfg, model)
    if cfg.deepspeed:
        model, optimizer = deepspeed_engine.initialize(cfg, model, optimizer)
    scaler = optim.scaler_for(cfg)
    if launch.compiles(cfg):  # as train.py: on CUDA unless --compile=false
        parallel.unwrap(model).compile_blocks()
        cross_entropy.compile_chain()
    train_model = model
    model.train()
    plan = schedule.Schedule(cfg, grid.dp_size)
    train_data, _ = loader.build_data(cfg, plan)
    B, T = cfg.global_batch_size, cfg.seq_length

    # With telemetry_interval, every interval-th timed step records telemetry, as in training: timed apart, so
    # that its cost can be stated per step (interleaved steps share the machine's noise); CPU time too.
    recorder = telemetry.Telemetry(model, cfg, optimizer) if cfg.telemetry_interval else None  # as train.py
    times, waits, key, probed, cpu = [], [], (1, 0, B, T), [], {False: [], True: []}
    with loader.batch_prefetcher(train_data, plan, cfg, device) as prefetcher:
        for it in range(bench.bench_warmup + bench.bench_steps):
            if it == bench.bench_warmup:
                parallel.pipeline_seconds.update(schedule=0.0, communicate=0.0)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    parallel.pipeline_events = {"schedule": [], "communicate": []}  # the host does not wait there
            timed = it >= bench.bench_warmup
            probe = recorder if recorder and timed and (it + 1 - bench.bench_warmup) % cfg.telemetry_interval == 0 \
                else None
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            batches = loader.to_device(prefetcher.get(key), device)
            t_data = time.perf_counter() - t0
            if probe:
                probe.begin()
            training.train_step(train_model, optimizer, scaler, batches, cfg.lr, cfg, device,
                             callbacks=telemetry.Probe(probe) if probe else training.NO_CALLBACKS)
            if probe:
                probe.finish()
            sync(device)
            if timed:
                (probed if probe else times).append(time.perf_counter() - t0)
                cpu[probe is not None].append(time.process_time() - c0)
                waits.append(t_data)
            key = plan.next_key(key)
        costs = None
        if profiled:  # kept out of the pipeline's times, which are of the timed iterations
            seconds, events, parallel.pipeline_events = dict(parallel.pipeline_seconds), parallel.pipeline_events, None
            costs = step_costs(lambda: loader.to_device(prefetcher.get(key), device),
                               lambda batches: training.train_step(train_model, optimizer, scaler, batches, cfg.lr, cfg,
                                                                device), optimizer, device)
            parallel.pipeline_seconds.update(seconds)
            parallel.pipeline_events = events
    t0 = time.perf_counter()  # what a batch costs when it was not prepared ahead
    loader.micro_batches(train_data, 0, B // (cfg.micro_batch_size * grid.dp_size), cfg, T, device)
    sync(device)
    load = time.perf_counter() - t0

    seconds = dict(parallel.pipeline_seconds)
    if parallel.pipeline_events is not None:  # CUDA: the stream's time between the events, after the sync above
        seconds = {kind: sum(a.elapsed_time(b) for a, b in pairs) / 1000
                   for kind, pairs in parallel.pipeline_events.items()}
        parallel.pipeline_events = None
    mine = (grid.pp_rank, seconds["communicate"], seconds["schedule"])
    stages = [mine]
    if dist.is_initialized():  # each stage's time in the pipeline and in its messages, for rank 0's report
        stages = [None] * grid.world_size
        dist.all_gather_object(stages, mine)
    stages = [next((c, p) for r, c, p in stages if r == stage) for stage in range(grid.pp_size)]
    if grid.rank != 0:
        return None
    mean, best = statistics.mean(times), min(times)
    flops = gpt.flops_per_iteration(B, T)
    tflops = flops / (mean * grid.world_size * 1e12)  # per GPU, as training's log line (lesson 23)
    model_tflops = gpt.model_flops_per_iteration(B, T) / (mean * grid.world_size * 1e12)  # without recomputation
    memory, memory_source = peak_memory(device)
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32  # of the matmuls
    peak, peak_source = device_peak(device, dtype)
    wait_share = sum(waits) / (sum(times) + sum(probed))
    print(f"model:        {gpt.num_parameters():,} parameters ({gpt.num_parameters(padded=True):,} with the vocabulary "
          f"padded to {gpt.padded_vocab_size}; {local_params:,} on this rank); {grid}\n"
          f"run:          {str(dtype).removeprefix('torch.')}, global batch {B} x {T} tokens (micro-batch "
          f"{cfg.micro_batch_size}), {bench.bench_steps} timed iterations after {bench.bench_warmup} warm-up, "
          f"{device}, {torch.get_num_threads()} threads\n"
          f"tokens/s:     {B * T / mean:,.1f} (best iteration {B * T / best:,.1f})\n"
          f"ms/iteration: {mean * 1000:.1f} (best {best * 1000:.1f}, stdev {statistics.pstdev(times) * 1000:.1f})\n"
          f"TFLOPs:       {tflops:.4g} per {'GPU' if device.type == 'cuda' else 'process'} (Megatron's formula, "
          f"recomputation included)\n"
          f"MFU:          {100 * model_tflops * 1e12 / peak:.1f}% of {peak / 1e12:.4g} TFLOP/s ({peak_source}): the "
          f"model's FLOPs alone, {model_tflops:.4g} TFLOPs (6N + attention, no recomputation)\n"
          f"peak memory:  {memory / 2**20:,.0f} MiB ({memory_source})\n"
          f"data wait:    {100 * wait_share:.3f}% of the iteration ({1000 * statistics.mean(waits):.2f} ms; loading "
          f"a batch not prepared ahead takes {1000 * load:.2f} ms)", flush=True)
    if costs:
        print(f"costs:        {costs_line(costs)} of one profiled iteration", flush=True)
    if probed:  # CPU time too: on a shared machine it is the steadier measure of the work added
        for what, plain, recording in (("wall", times, probed), ("CPU", cpu[False], cpu[True])):
            plain, recording = statistics.median(plain), statistics.median(recording)
            print(f"telemetry:    {what} {recording * 1000:.1f} ms per recording step vs {plain * 1000:.1f} ms "
                  f"(medians of {len(probed)} and {len(times)}): +{100 * (recording / plain - 1):.1f}% per "
                  f"recording step, +{10 * (recording / plain - 1):.2f}% at telemetry_interval=10", flush=True)
    result = {"mean": mean, "best": best, "wait_share": wait_share, "layout": repr(grid), "stages": stages,
              "tokens/s": B * T / mean, "TFLOPs": tflops, "MFU": model_tflops * 1e12 / peak, "memory": memory,
              "micro_batches": B // (cfg.micro_batch_size * grid.dp_size), "pp": grid.pp_size, "costs": costs}
    if grid.pp_size > 1:
        result["bubble"] = [comm / pipe for comm, pipe in stages]
        ideal = (grid.pp_size - 1) / (result["micro_batches"] + grid.pp_size - 1)
        print("bubble:       " + ", ".join(f"stage {p} waits {100 * b:.1f}%" for p, b in enumerate(result["bubble"]))
              + f" of its forward-backward; ideal (p-1)/(m+p-1) = {100 * ideal:.1f}% (p={grid.pp_size}, "
              f"m={result['micro_batches']})", flush=True)
    return result


# -----------------------------------------------------------------------------
# Where one iteration's time goes: one profiled iteration, its ops' time in shares

COSTS = ("output layer + loss", "attention", "other matmuls", "elementwise and other ops", "optimizer",
         "gradient accumulation / reduction", "data wait", "other")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
           "aten::_addmm_activation"}
# Ranges around the parts of training.train_step that an op's name cannot place (an add_ is an add_), set for the
# profiled iteration by costs_named. Gradient accumulation's own: autograd's AccumulateGrad, where
# parallel.GradBuffer's hook adds each .grad into its bucket and starts the DP all-reduce.
RANGES = {"bench: data wait": "data wait", "bench: optimizer": "optimizer", "Optimizer.step#": "optimizer",
          "bench: gradient reduction": "gradient accumulation / reduction",
          "torch::autograd::AccumulateGrad": "gradient accumulation / reduction"}


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
    """For the profiled iteration: the optimizer's part of training.train_step (zero_grad, the grad norm and the count
    of zeros, unscaling, clipping, the step; DeepSpeed's finish_step) and the wait for the DP all-reduce
    (parallel.reduce_gradients) run inside named ranges; undone on the way out."""
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
    for owner, attribute in ((parallel, "grad_norm"), (parallel, "count_zeros"), (optim, "clip_grads")):
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


def step_costs(fetch, run, optimizer, device):
    """{cost: share of the iteration} (COSTS, summing to 1) of one iteration: batches = fetch(), run(batches),
    under torch.profiler. Each op's own time goes to cost_of its chain of ranges; on a GPU its kernels' time
    (what the GPU spent on it), on the CPU its host time on this thread (the prefetch thread's is not the
    step's). The data wait is the host's wait for the batch. "other": the iteration's wall time that no op
    accounts for; when the ops add up to more (kernels on overlapping streams: NCCL's beside the compute's),
    the shares are of their sum and "other" is 0."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with costs_named(optimizer), profile(activities=activities) as prof:
        sync(device)
        t0 = time.perf_counter()
        with record_function("bench: step"):
            with record_function("bench: data wait"):
                batches = fetch()
            run(batches)
        sync(device)
        wall = (time.perf_counter() - t0) * 1e6  # microseconds, the profiler's unit
    # the host's events: ops and ranges (a kernel's time is its launching op's self_device_time_total; the
    # kernels' own events and the ranges' GPU-side copies would count it again)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
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
    spent["data wait"] = next(e for e in events if e.name == "bench: data wait").cpu_time_total
    spent["other"] = 0.0
    total = max(wall, sum(spent.values()))
    spent["other"] = total - sum(spent.values())
    return {cost: t / total for cost, t in spent.items()}


def costs_line(costs):
    return ", ".join(f"{cost} {100 * share:.1f}%" for cost, share in costs.items())


def _worker(rank, nproc, port, argv, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # the cores shared out, not oversubscribed
    try:
        result = measure(argv)
        if rank == 0:
            results.put(result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def table(argv):
    """One process per configuration, one after the other, then a row each: what a GPU's note quotes."""
    configs = [a for a in argv if a.endswith(".py")]
    others = [a for a in argv if not a.endswith(".py") and a != "--table"]
    rows = [(name, measure([name, *others])) for name in configs]
    print("\n| config | tokens/s | TFLOPs (Megatron) | MFU (model FLOPs) | peak memory |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        print(f"| {os.path.basename(name)[:-3]} | {r['tokens/s']:,.0f} | {r['TFLOPs']:.1f} | {100 * r['MFU']:.1f}% | "
              f"{r['memory'] / 2**30:.1f} GiB |")
    costed = [(name, r["costs"]) for name, r in rows if r["costs"]]
    if costed:  # where each config's iteration goes: what to make faster first
        print("\n| config | " + " | ".join(COSTS) + " |\n| --- |" + " ---: |" * len(COSTS))
        for name, costs in costed:
            print(f"| {os.path.basename(name)[:-3]} | " + " | ".join(f"{100 * costs[c]:.1f}%" for c in COSTS) + " |")
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench, rest = parse(argv)
    if bench.table:
        return table(argv)
    if bench.nproc <= 1:
        return measure(argv)
    print("-- 1 process, the same global batch", flush=True)
    single = measure(rest + ["--tensor_model_parallel_size=1", "--pipeline_model_parallel_size=1",
                             f"--bench_steps={bench.bench_steps}", f"--bench_warmup={bench.bench_warmup}"])
    print(f"-- {bench.nproc} processes", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_worker, args=(bench.nproc, port, argv, results), nprocs=bench.nproc,
                                          start_method="spawn")
    multi = results.get()
    print(f"-- {multi['layout']} against 1 process: {multi['best'] * 1000:.0f} vs {single['best'] * 1000:.0f} ms "
          f"per iteration (best), {single['best'] / multi['best']:.2f}x the throughput "
          f"(means {multi['mean'] * 1000:.0f} vs {single['mean'] * 1000:.0f} ms: "
          f"{single['mean'] / multi['mean']:.2f}x)")
    return multi


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # configuration errors: one clear line, as train.py
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
