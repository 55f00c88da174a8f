"""Measure the speed of one training iteration: forward, backward, gradient clipping and the optimizer step.

    python bench.py config/gpt2_125m.py                            # a config file, then --key=value overrides
    python bench.py config/tiny.py --hidden_size=384 --bench_steps 20 --bench_warmup 3
    torchrun --nproc_per_node 8 bench.py config/tr3_1b3.py        # TFLOPs and MFU are per GPU

The model, optimizer and loss scaler are built by train.py's own functions and each iteration is train.train_step,
so what is timed is what training runs. The batches are random tokens: data loading is left out on purpose (it
overlaps with compute in a real run, and this measures the model). Reported: tokens/s, ms per iteration, achieved
TFLOPs by Megatron's formula (the number training logs), MFU against the device's peak, peak memory (rank 0's).
On a shared CPU other processes move these numbers a lot: compare runs taken back to back, alternating.
"""
import argparse
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

import arguments
import deepspeed_engine
import parallel
import train

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--bench_steps", "--bench-steps", type=int, default=10, help="timed iterations")
    parser.add_argument("--bench_warmup", "--bench-warmup", type=int, default=2,
                        help="untimed iterations first (allocator, thread pools, torch.compile, optimizer state)")
    bench, rest = parser.parse_known_args(argv)
    cfg = arguments.load_config(rest)  # the rest is CONFIG.py --key=value ..., exactly as train.py takes it
    grid = parallel.init(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                         backend="nccl" if train.use_cuda(cfg) else "gloo")
    if cfg.rampup_batch_size is not None:
        train.print0("bench: rampup_batch_size ignored, every iteration uses global_batch_size")
        cfg.rampup_batch_size = None
    cfg.train_iters = bench.bench_warmup + bench.bench_steps  # validate() wants a length of training
    arguments.validate(cfg, grid.world_size, reads_data=False)  # random tokens
    device = train.get_device(cfg)
    torch.manual_seed(cfg.seed)  # same seed on every rank: TP ranks must see the same tokens

    model = train.build_model(cfg, device)
    gpt, local_params = model.cfg, sum(p.numel() for p in model.parameters())
    optimizer = train.build_optimizer(cfg, model)
    if cfg.deepspeed:
        model, optimizer = deepspeed_engine.initialize(cfg, model, optimizer)
    scaler = train.build_scaler(cfg)
    train_model = torch.compile(model) if cfg.compile else model
    model.train()

    # This rank's micro-batches of one global batch of random tokens, reused every iteration.
    B, T, mbs = cfg.global_batch_size, cfg.seq_length, cfg.micro_batch_size
    batches = [(torch.randint(0, cfg.vocab_size, (mbs, T), device=device),
                torch.randint(0, cfg.vocab_size, (mbs, T), device=device))
               for _ in range(B // (mbs * grid.dp_size))]

    for _ in range(bench.bench_warmup):
        train.train_step(train_model, optimizer, scaler, batches, cfg.lr, cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(bench.bench_steps):
        sync(device)
        t0 = time.perf_counter()
        train.train_step(train_model, optimizer, scaler, batches, cfg.lr, cfg, device)
        sync(device)
        times.append(time.perf_counter() - t0)

    mean, best = statistics.mean(times), min(times)
    flops = train.flops_per_iteration(cfg, gpt.padded_vocab_size, B, T)
    tflops = flops / (mean * grid.world_size * 1e12)  # per GPU, as training's log line (lesson 23)
    memory, memory_source = peak_memory(device)
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32  # of the matmuls
    peak, peak_source = device_peak(device, dtype)
    train.print0(
        f"model:        {gpt.num_parameters():,} parameters ({gpt.num_parameters(padded=True):,} with the vocabulary "
        f"padded to {gpt.padded_vocab_size}; {local_params:,} on this rank); {grid}\n"
        f"run:          {str(dtype).removeprefix('torch.')}, global batch {B} x {T} tokens (micro-batch {mbs}), "
        f"{bench.bench_steps} timed iterations after {bench.bench_warmup} warm-up, {device}\n"
        f"tokens/s:     {B * T / mean:,.1f} (best iteration {B * T / best:,.1f})\n"
        f"ms/iteration: {mean * 1000:.1f} (best {best * 1000:.1f}, stdev {statistics.pstdev(times) * 1000:.1f})\n"
        f"TFLOPs:       {tflops:.4g} per {'GPU' if device.type == 'cuda' else 'process'} (Megatron's formula)\n"
        f"MFU:          {100 * tflops * 1e12 / peak:.1f}% of {peak / 1e12:.4g} TFLOP/s ({peak_source})\n"
        f"peak memory:  {memory / 2**20:,.0f} MiB ({memory_source})")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # configuration errors: one clear line, as train.py
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
