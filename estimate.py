"""Will a layout fit? Parameter counts and memory per GPU of a TP x PP x DP layout, computed without a GPU.

`python train.py CONFIG --dry_run` lands here: every pipeline stage is built on the meta device (shapes, no
memory) for a grid on paper (parallel.Grid with world_size given: sizes and ranks, no processes), so the counts
are those of the real model code, not of a second formula that could drift from it. The memory model is the
back-of-the-envelope of lesson 16 (docs/lessons.md), written out.
"""
import os

import torch

import parallel
from model import GPT, GPTConfig


def dry_run(cfg, world_size=None, file=None):
    """Build every pipeline stage of TP rank 0 on the meta device (no memory, no processes) and print the
    parameter counts and the memory each GPU needs.

    The number of GPUs is not in the config: it is WORLD_SIZE (as torchrun or SLURM would set it, e.g.
    `WORLD_SIZE=256 python train.py config/tr8b_104b.py --dry_run`), default TP x PP (DP=1).
    Memory per parameter follows lesson 16 (docs/lessons.md): mixed precision 2 (half weights) + 4 (fp32
    master) + 8 (Adam moments) + 4 (gradients) bytes, fp32 4 + 8 + 4; ZeRO-1 divides the optimizer states by
    DP, ZeRO-2 the gradients too. Activations per layer and micro-batch, 16-bit, without sequence parallelism
    (Korthikanti et al. 2022): s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes (34 + 5as/h for t=1); with checkpointing
    only each layer's input, 2*s*b*h, is kept, plus one layer's full activations while it is recomputed.
    Under 1F1B the first stage holds min(pp, micro-batches) micro-batches in flight."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    world = world_size or int(os.environ.get("WORLD_SIZE", tp * pp))
    if world % (tp * pp):
        raise ValueError(f"WORLD_SIZE {world} is not divisible by tensor_model_parallel_size ({tp}) x "
                         f"pipeline_model_parallel_size ({pp}); set WORLD_SIZE to a multiple of {tp * pp}")
    dp = world // (tp * pp)
    partition = parallel.partition_layers(cfg.num_layers, pp, cfg.pp_partition_method)
    model_cfg, stages = GPTConfig.from_config(cfg), []
    for stage in range(pp):
        paper = parallel.Grid(tp, pp, world_size=world, rank=stage * dp * tp)  # TP rank 0 of this stage
        with torch.device("meta"):
            gpt = GPT(model_cfg, partition[stage], pre_process=stage == 0, post_process=stage == pp - 1,
                      grid=paper)
        gpu = sum(p.numel() for p in gpt.parameters())
        full = sum(p.numel() * (tp if getattr(p, "tp_dim", None) is not None else 1)
                   for p in gpt.parameters() if p is not gpt.output_weight)
        stages.append((gpu, full))
    padded_vocab = model_cfg.padded_vocab_size
    padded_total, formula = sum(full for _, full in stages), model_cfg.num_parameters()

    def say(text=""):
        print(text, file=file, flush=True)

    GiB = 2**30
    mixed = cfg.fp16 or cfg.bf16
    say(f"dry run: TP={tp} x PP={pp} x DP={dp} = {world} GPUs (WORLD_SIZE; default TP x PP), nothing allocated")
    say(f"model: {formula / 1e9:.2f}B parameters (lesson 16's formula), {padded_total / 1e9:.2f}B with the "
        f"vocabulary padded to {padded_vocab}; the last stage's copy of the tied embedding is not counted")
    say(f"{'stages':>10} {'layers/stage':>13} {'params/stage':>15} {'params/GPU':>15}")
    start = 0
    for s in range(pp + 1):  # consecutive stages of the same size on one row
        if s == pp or stages[s] != stages[start]:
            label = f"{start}" if s - 1 == start else f"{start}-{s - 1}"
            say(f"{label:>10} {len(partition[start]):>13} {stages[start][1]:>15,} {stages[start][0]:>15,}")
            start = s

    gpu_params = max(gpu for gpu, _ in stages)
    weights = 2 + 4 if mixed else 4  # half weights + fp32 master, or fp32 weights
    optimizer_states = 4 + 8 if mixed else 8  # what ZeRO shards: master weights (mixed) and Adam moments
    grads = 4

    def model_states(zero):
        shard = (optimizer_states / dp if zero >= 1 else optimizer_states) + (grads / dp if zero >= 2 else grads)
        return gpu_params * (weights - (4 if mixed else 0) + shard)

    precision = ("fp16" if cfg.fp16 else "bf16") if mixed else "fp32"
    per_param = weights + 8 + grads
    say(f"model states of the whole model without ZeRO: {per_param} B x {formula / 1e9:.2f}B = "
        f"{per_param * formula / 1e9:,.0f} GB (lesson 16: 18 x 104 = 1872 GB for tr8b-104B)")
    say(f"model states per GPU (largest stage, {gpu_params:,} parameters, {precision}, Adam):")
    for zero in (0, 1, 2):
        mark = "  <- configured" if zero == cfg.zero_stage else ""
        say(f"  ZeRO-{zero} over DP={dp}: {model_states(zero) / GiB:8.2f} GiB{mark}")

    s, b, h, a = cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    gbs = cfg.global_batch_size or b * dp
    micro = max(1, gbs // (b * dp))
    # Under 1F1B stage k holds min(pp - k, micro) micro-batches in flight; with uneven stages the stage holding
    # the most layer activations need not be the first (BLOOM on PP=12: stage 1, 6 layers x 11 in flight).
    held = [len(partition[k]) * min(pp - k, micro) for k in range(pp)]
    busiest = max(range(pp), key=held.__getitem__)
    in_flight = min(pp - busiest, micro)
    full_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    without = held[busiest] * full_layer
    with_ckpt = held[busiest] * 2 * s * b * h + full_layer
    say(f"activations on stage {busiest} (seq {s}, micro batch {b}, {micro} micro-batches, {in_flight} in flight):")
    say(f"  without checkpointing: {without / GiB:8.2f} GiB, with checkpointing: {with_ckpt / GiB:8.2f} GiB"
        f"{'  <- configured' if cfg.checkpoint_activations else ''}")
    total = model_states(cfg.zero_stage) + (with_ckpt if cfg.checkpoint_activations else without)
    say(f"estimated total per GPU: {total / GiB:.2f} GiB (plus temporaries: logits, communication buffers)")
    return {"params": formula, "padded_params": padded_total, "stages": stages, "gpu_params": gpu_params,
            "dp": dp, "model_states": model_states(cfg.zero_stage), "activations": without,
            "activations_checkpointed": with_ckpt}
