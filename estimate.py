"""Will a layout fit? Parameter counts and memory per GPU of a TP x PP x DP layout, computed without a GPU.

`python train.py CONFIG --dry_run` lands here: every pipeline stage is built on the meta device (shapes, no
memory) for a grid on paper (parallel.Grid with world_size given: sizes and ranks, no processes), so the counts
are those of the real model code, not of a second formula that could drift from it. The memory model is the
back-of-the-envelope of lesson 16 (docs/lessons.md), written out.
"""

import os
from typing import NamedTuple

import torch

import arguments
import deepspeed_engine
import launch
import parallel
import precision
import stability
from model import GPT, GPTConfig
from optim import OptimizerConfig
from sections import section
from stability import snapshots


def dry_run(cfg, world_size=None, file=None):
    """Build every pipeline stage of TP rank 0 on the meta device (no memory, no processes) and print the
    parameter counts and the memory each GPU needs.

    The number of GPUs is not in the config: it is WORLD_SIZE (as torchrun or SLURM would set it, e.g.
    `WORLD_SIZE=256 python train.py config/tr8b_104b.py --dry_run`), default TP x PP (DP=1).
    Memory per parameter: bytes_per_parameter, what the code allocates (tests/test_parallel.py measures it).
    Activations per layer and micro-batch: layer_activations (Korthikanti et al. 2022's count, GQA's smaller keys
    and values, SwiGLU's gate); with checkpointing only each layer's input, 2*s*b*h, is kept, plus one layer's
    full activations while it is recomputed.
    Under 1F1B the first stage holds min(pp, micro-batches) micro-batches in flight.

    A tool of the upper floor, as train.py's own: it reads the whole config (cfg) and prepares it,
    then hands its helpers the model's section and the few values of other owners the memory
    follows from (Plan)."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    world = world_size or launch.world_size(default=tp * pp)
    if world % (tp * pp):
        raise ValueError(
            f"WORLD_SIZE {world} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}); set WORLD_SIZE to a multiple of {tp * pp}"
        )
    # a layout that cannot train is refused here too
    arguments.prepare(cfg, world, reads_data=False)
    paper = build_stages(section(GPTConfig, cfg), pp, cfg.pp_partition_method, world)
    zero = cfg.zero_stage
    if cfg.deepspeed:  # the stage DeepSpeed runs: bf16's 0 is 1
        zero = deepspeed_engine.zero_stage_run(cfg.bf16, zero)
    plan = Plan(
        precision.name(section(OptimizerConfig, cfg)),
        cfg.deepspeed,
        zero,
        cfg.micro_batch_size,
        cfg.global_batch_size,
    )

    def say(text=""):
        print(text, file=file, flush=True)

    say(
        f"dry run: TP={tp} x PP={pp} x DP={paper.dp} = {world} GPUs (WORLD_SIZE; default TP x PP), nothing allocated"
    )
    say_parameters(paper, say)
    say_model_states(plan, paper, say, cfg.zero_stage)
    activations = say_activations(plan, paper, say)
    say_snapshots(cfg, paper, world, say)
    return {
        "params": paper.params,
        "padded_params": paper.padded_total,
        "stages": paper.stages,
        "gpu_params": paper.gpu_params,
        "dp": paper.dp,
        "model_states": model_states(plan, paper, plan.zero_stage),
        **activations,
    }


class Plan(NamedTuple):
    """What the memory follows from besides the model, of other owners' keys: dry_run makes it."""

    precision: str  # fp32 | bf16 | fp16 (precision.name)
    deepspeed: bool
    zero_stage: int
    micro_batch_size: int
    global_batch_size: int | None


class Stages(NamedTuple):
    """The pipeline stages of TP rank 0, built on the meta device: what the memory of a layout follows from."""

    dp: int
    partition: list  # the layers of each stage
    model_cfg: GPTConfig
    stages: list  # (parameters on one GPU, parameters of the stage over its TP ranks) per stage
    # per stage: the most optimizer-state elements of one DP rank under native ZeRO-1
    largest_shard: list
    params: int  # of the model, unpadded
    padded_total: int  # of the stages, the vocabulary padded

    @property
    def gpu_params(self):
        return max(gpu for gpu, _ in self.stages)


def build_stages(model_cfg, pp, pp_partition_method, world):
    """The Stages of model_cfg's model over pp stages (pp_partition_method: the layout's)."""
    tp = model_cfg.tensor_model_parallel_size
    dp = world // (tp * pp)
    partition = parallel.partition_layers(model_cfg.num_layers, pp, pp_partition_method)
    stages, largest_shard = [], []
    for stage in range(pp):
        # TP rank 0 of this stage
        paper = parallel.Grid(tp, pp, world_size=world, rank=stage * dp * tp)
        with torch.device("meta"):
            gpt = GPT(
                model_cfg,
                partition[stage],
                pre_process=stage == 0,
                post_process=stage == pp - 1,
                grid=paper,
            )
        gpu = sum(p.numel() for p in gpt.parameters())
        full = sum(
            p.numel() * (tp if getattr(p, "tp_dim", None) is not None else 1)
            for p in gpt.parameters()
            if p is not gpt.output_weight
        )
        stages.append((gpu, full))
        # native ZeRO-1 deals out whole parameters: the DP rank with the most elements of optimizer state
        largest_shard.append(
            max(parallel.shard_numels([p.numel() for p in gpt.parameters() if p.requires_grad], dp))
        )
    return Stages(
        dp,
        partition,
        model_cfg,
        stages,
        largest_shard,
        model_cfg.num_parameters(),
        sum(full for _, full in stages),
    )


def say_parameters(paper, say):
    """The model's size, then one row per run of consecutive stages of the same size."""
    stages, partition = paper.stages, paper.partition
    say(
        f"model: {paper.params / 1e9:.2f}B parameters, {paper.padded_total / 1e9:.2f}B with the "
        f"vocabulary padded to {paper.model_cfg.padded_vocab_size}; the last stage's copy of the tied embedding is "
        "not counted"
    )
    say(f"{'stages':>10} {'layers/stage':>13} {'params/stage':>15} {'params/GPU':>15}")
    start = 0
    for s in range(len(stages) + 1):
        if s == len(stages) or stages[s] != stages[start]:
            label = f"{start}" if s - 1 == start else f"{start}-{s - 1}"
            say(
                f"{label:>10} {len(partition[start]):>13} {stages[start][1]:>15,} {stages[start][0]:>15,}"
            )
            start = s


def model_states(plan, paper, zero):
    """Of the GPU that needs the most: with native ZeRO-1 the rank holding the most optimizer state (whole
    parameters are dealt out: tr11's embedding shard makes its rank the largest), else the largest stage."""
    dp = paper.dp
    if zero == 0 or plan.deepspeed:  # DeepSpeed partitions a flat buffer evenly
        per_param = bytes_per_parameter(plan.precision, zero, dp, plan.deepspeed)
        return paper.gpu_params * sum(per_param.values())
    whole = bytes_per_parameter(plan.precision, 0, dp)
    return max(
        gpu * (whole["weights"] + whole["gradients"]) + shard * whole["optimizer"]
        for (gpu, _), shard in zip(paper.stages, paper.largest_shard)
    )


def say_model_states(plan, paper, say, configured):
    """Lesson 16's textbook count, then what each ZeRO stage leaves on the GPU that needs the most. configured:
    the config's zero_stage, where DeepSpeed runs another (plan.zero_stage)."""
    GiB, params, dp = 2**30, paper.params, paper.dp
    dtype, deepspeed = plan.precision, plan.deepspeed
    per_param = (2 + 4 if dtype != "fp32" else 4) + 8 + 4  # weights (+ master), Adam, gradients
    say(
        f"model states of the whole model without ZeRO: {per_param} B x {params / 1e9:.2f}B = "
        f"{per_param * params / 1e9:,.0f} GB (lesson 16: 18 x 104 = 1872 GB for tr8b-104B)"
    )
    path = "DeepSpeed" if deepspeed else "native"
    say(
        f"model states per GPU as the {path} path allocates them (largest "
        f"stage, {paper.gpu_params:,} parameters, {dtype}, Adam):"
    )
    for zero in (0, 1, 2) if deepspeed else (0, 1):
        parts = bytes_per_parameter(dtype, zero, dp, deepspeed)
        mark = "  <- configured" if zero == plan.zero_stage else ""
        if mark and zero != configured:
            mark += f" (zero_stage={configured} runs as {zero} under DeepSpeed with {dtype})"
        even = paper.gpu_params * sum(parts.values())
        states = model_states(plan, paper, zero)
        uneven = (
            ""
            if abs(states - even) < 0.005 * GiB
            else f" on the largest rank (an even share would be {even / GiB:.2f} GiB)"
        )
        say(
            f"  ZeRO-{zero} over DP={dp}: {states / GiB:8.2f} GiB{uneven} = "
            + " + ".join(f"{v:.3g} ({k})" for k, v in parts.items())
            + f" B/param{mark}"
        )


def say_activations(plan, paper, say):
    """The activations of the stage holding the most under 1F1B, with and without checkpointing, and the total per
    GPU; returns {"activations", "activations_checkpointed"} in bytes."""
    GiB, pp, partition, model_cfg = 2**30, len(paper.partition), paper.partition, paper.model_cfg
    s, b, h = model_cfg.seq_length, plan.micro_batch_size, model_cfg.hidden_size
    checkpointed = model_cfg.checkpoint_activations
    gbs = plan.global_batch_size or b * paper.dp
    micro = max(1, gbs // (b * paper.dp))
    # Under 1F1B stage k holds min(pp - k, micro) micro-batches in flight; with uneven stages the stage holding
    # the most layer activations need not be the first (BLOOM on PP=12: stage 1, 6 layers x 11 in flight).
    held = [len(partition[k]) * min(pp - k, micro) for k in range(pp)]
    busiest = max(range(pp), key=held.__getitem__)
    in_flight = min(pp - busiest, micro)
    full_layer = layer_activations(model_cfg, s, b, model_cfg.tensor_model_parallel_size)
    without = held[busiest] * full_layer
    with_ckpt = held[busiest] * 2 * s * b * h + full_layer
    say(
        f"activations on stage {busiest} (seq {s}, micro batch {b}, {micro} micro-batches, {in_flight} in flight):"
    )
    say(
        f"  without checkpointing: {without / GiB:8.2f} GiB, with checkpointing: {with_ckpt / GiB:8.2f} GiB"
        f"{'  <- configured' if checkpointed else ''}"
    )
    total = model_states(plan, paper, plan.zero_stage) + (with_ckpt if checkpointed else without)
    say(
        f"estimated total per GPU: {total / GiB:.2f} GiB (plus temporaries: logits, communication buffers)"
    )
    return {"activations": without, "activations_checkpointed": with_ckpt}


def say_snapshots(cfg, paper, world, say):
    """The spike guard's snapshots in host memory, per node: a line when they are on, and whether they fit."""
    # the GPU whose snapshot is largest: with native ZeRO-1 the rank holding the most optimizer state
    native_zero = cfg.zero_stage >= 1 and not cfg.deepspeed
    one = max(
        snapshots.snapshot_bytes(
            stability.snapshot_plan(cfg), gpu, paper.dp, shard if native_zero else None
        )
        for (gpu, _), shard in zip(paper.stages, paper.largest_shard)
    )
    # GPUs per node: LOCAL_WORLD_SIZE as torchrun sets it, else a node of 8 (the node's memory: this machine's)
    line, problem = snapshots.describe_host_memory(
        stability.snapshot_plan(cfg), one, int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
    )
    if line:
        say(line)
    if problem:
        say(f"does not fit: {problem}")


def layer_activations(model_cfg, s, b, tp=1):
    """Bytes one transformer layer keeps for backward per micro-batch of b samples of s tokens, 16-bit, without
    sequence parallelism: Korthikanti et al. 2022's count, s*b*h*(10 + 24/t + 5*a*s/(h*t)) for the GPT-2 block
    (34 + 5as/h at t=1), written per tensor so that the Llama block's follow from its shapes:
      not split by TP, 10sbh: the inputs of the two norms (4), of the QKV projection and of the MLP (4), the two
        dropout masks (2, a byte each)
      attention, split: Q 2sbh, K and V 2sbh each times groups/heads (GQA, num_query_groups: the flash kernel
        takes them unexpanded), the output projection's input 2sbh (the kernel's output), and the softmax's
        log-sum-exp per query, 4asb in fp32: the fused kernels (flash, memory-efficient) recompute the scores in
        backward and draw the dropout mask again from a seed. Only unfused_attention keeps the scores, softmax,
        its dropout mask and the dropped-out probabilities, Korthikanti et al.'s 5as^2b
      MLP of width f, split: GeLU's input and output 4sbf (16sbh at f = 4h); SwiGLU's gate and up outputs, the
        SiLU's output and the product fc2 takes, 8sbf"""
    h, a, f = model_cfg.hidden_size, model_cfg.num_attention_heads, model_cfg.ffn_size
    kv = 2 * (2 * s * b * h * model_cfg.query_groups / a)
    scores = 5 * a * s * s * b if model_cfg.unfused_attention else 4 * a * s * b
    attention = 2 * s * b * h + kv + 2 * s * b * h + scores
    mlp = (8 if model_cfg.swiglu else 4) * s * b * f
    return 10 * s * b * h + (attention + mlp) / tp


def bytes_per_parameter(precision, zero_stage, dp, deepspeed=False):
    """Model-state bytes per parameter as the code allocates them: {"weights", "gradients", "optimizer"}.

    Native path (precision.py; parallel.GradBuffer; ZeRO-1 = parallel.ZeroShardedOptimizer divides "optimizer"):
        fp32: 4 weights + 4 gradient buffer + 8 Adam moments                               = 4 + 4 + 8/DP
        bf16, fp16: 2 weights + 4 fp32 gradient buffer (the masters step with views of it)
                    + 4 fp32 masters + 8 moments                                          = 2 + 4 + 12/DP
    DeepSpeed (lesson 16's textbook count, DeepSpeed's own buffers not modelled): 2 or 4 weights + 4 gradients +
    12 (master + moments) or 8; ZeRO-1 divides the optimizer by DP, ZeRO-2 the gradients too.
    bitsandbytes' 8-bit Adam would hold about 2 bytes of moments instead of 8 (not modelled)."""
    half = precision != "fp32"
    weights = 2 if half else 4
    if deepspeed:
        grads, optimizer = 4, (12 if half else 8)
    else:
        grads, optimizer = 4, 8 + (4 if half else 0)
    return {
        "weights": weights,
        "gradients": grads / dp if deepspeed and zero_stage >= 2 else grads,
        "optimizer": optimizer / dp if zero_stage >= 1 else optimizer,
    }
