"""What a run is made of, built from its config: the model (initialised from a Hugging Face model if asked), the
optimizer and loss scaler, DeepSpeed's engine, the callbacks. train.py, bench.py and the tools build through here.

    model = build_model(cfg, device)                 # this rank's stage, in the compute dtype
    optimizer = build_optimizer(cfg, model)          # optim.optimizer_for, of its section
    parts = build(cfg, grid, schedule, device, cb)   # run_state.Parts: model, optimizer, scaler, a fresh RunState
    rules = step_rules(cfg)                          # training.StepRules (parts.rules)
    callbacks = build_callbacks(cfg, writer, saved)  # the stability layer's list, or training.NO_CALLBACKS

This is the one file that knows every part: the parts themselves (model.py, optim.py, hf.py, stability/) never
import each other to build themselves. It hands each part its section of the config
(sections.section), and the values it needs from other owners as arguments.
"""

import torch

import checkpoint
import deepspeed_engine
import hf
import launch
import layers
import loader
import optim
import parallel
import precision
import run_state

# its package holds the switches alone: a module of the layer is imported when one asks
import stability
import training
from model import GPT, GPTConfig, check_attention_backend, describe_partition
from optim import OptimizerConfig
from report import print0
from sections import section


def build_model(cfg, device):
    """This rank's stage, its weights in the compute dtype (precision.py); on the native path with the GradBuffer
    its gradients accumulate and are all-reduced in (DeepSpeed brings its own)."""
    g = parallel.grid
    layers = parallel.partition_layers(cfg.num_layers, g.pp_size, cfg.pp_partition_method)[
        g.pp_rank
    ]
    # Allocated on the device directly; the weights are drawn once, on the CPU (GPT.init_weights), for this rank's
    # slice only, and copied in. The ambient device is only where the parameters are allocated.
    with torch.device(device):
        model = GPT(
            section(GPTConfig, cfg),
            layers,
            pre_process=g.is_first_stage,
            post_process=g.is_last_stage,
            seed=cfg.seed,
        )
    if cfg.init_from_hf:
        init_from_hf(cfg, model)
    optim_cfg = section(OptimizerConfig, cfg)  # fp16, bf16: the precision's keys
    model.to(precision.compute_dtype(optim_cfg))
    if not cfg.deepspeed:
        parallel.attach_grad_buffer(model, precision.grad_dtype(optim_cfg))
    return model


def check_attention(cfg, device):
    """attention_backend's kernel checked on this device before the build (model.check_attention_backend). Packed
    documents attend through a dense mask unless they go through FlexAttention (layers.flex_documents), which no
    backend names."""
    model_cfg = section(GPTConfig, cfg)
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    compiled = launch.compiles(section(parallel.LayoutConfig, cfg))
    documents = cfg.reset_attention_mask and not layers.flex_documents(device, compiled, head_dim)
    dtype = precision.compute_dtype(section(OptimizerConfig, cfg))
    check_attention_backend(model_cfg, device, dtype, documents)


def build_optimizer(cfg, model):
    """The optimizer of model (optim.optimizer_for): the optimizer's keys, the schedule's peak
    lr, the layout's deepspeed and zero_stage."""
    return optim.optimizer_for(
        section(OptimizerConfig, cfg), model, cfg.lr, cfg.deepspeed, cfg.zero_stage
    )


def build_deepspeed(cfg, model, optimizer):
    """(the model to run, the optimizer to step) of deepspeed=True (deepspeed_engine.initialize)."""
    optim_cfg = section(OptimizerConfig, cfg)
    return deepspeed_engine.initialize(
        optim_cfg, model, optimizer, cfg.zero_stage, cfg.micro_batch_size
    )


def _resumes(cfg):
    return bool(cfg.load and checkpoint.latest_dir(cfg.load))


def check_init_from_hf(cfg):
    """The weight files of init_from_hf checked from their headers (hf.check_weights) before anything is built: a
    download that is not the model its config.json describes stops the run before the data's index and the
    model's build, not after them. Not read when the run resumes (init_from_hf)."""
    if cfg.init_from_hf and not _resumes(cfg):
        hf.check_weights(section(GPTConfig, cfg), cfg.init_from_hf)


def init_from_hf(cfg, model):
    """The weights of the Hugging Face model cfg.init_from_hf (hf.load_into), unless the run resumes: then the
    checkpoint's weights win and the model directory is not read."""
    if _resumes(cfg):
        print0(
            f"init_from_hf {cfg.init_from_hf} not loaded: resuming from the checkpoint in {cfg.load}, whose "
            "weights win"
        )
        return
    hf.load_into(model, cfg.init_from_hf)
    print0(f"initialised from the Hugging Face model in {cfg.init_from_hf}")


def build(cfg, grid, schedule, device, callbacks=training.NO_CALLBACKS):
    """This rank's model, optimizer and loss scaler, a fresh run state: the run_state.Parts."""
    model = build_model(cfg, device)
    gpt = model.config
    n, padded = gpt.num_parameters(), gpt.num_parameters(padded=True)
    print0(
        f"Model size: {n / 1e9:.3f}B ({n:,} parameters; {padded:,} with the vocabulary padded to "
        f"{gpt.padded_vocab_size})"
    )
    print0(
        f"{grid}; training for {schedule.total_iters} iterations, {schedule.total_samples:,} samples"
    )
    if grid.pp_size > 1:
        print0(describe_partition(cfg.num_layers, grid.pp_size, cfg.pp_partition_method))
    optimizer = build_optimizer(cfg, model)
    if cfg.deepspeed:
        model, optimizer = build_deepspeed(cfg, model, optimizer)
    print0(schedule.describe())
    scaler = optim.scaler_for(section(OptimizerConfig, cfg))
    parts = run_state.Parts(cfg, model, optimizer, schedule, scaler, callbacks, step_rules(cfg))
    if cfg.init_from_hf:  # a resumed run's comes from its checkpoint (run_state.load)
        parts.state.hf_origin = hf.origin(cfg.init_from_hf)
    return parts


def step_rules(cfg):
    """What a step and an evaluation read of the config (training.StepRules), made once, here."""
    return training.StepRules(
        clip_grad=cfg.clip_grad,
        skip_grad_norm_above=cfg.skip_grad_norm_above,
        fp16=cfg.fp16,
        deepspeed=cfg.deepspeed,
        z_loss=cfg.z_loss,
        packing=loader.packing(cfg),
        eval_iters=cfg.eval_iters,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        seq_length=cfg.seq_length,
    )


def build_callbacks(cfg, writer=None, saved_state=None):
    """The run's callbacks: the stability layer's, in the order it states (stability.build_callbacks), or none. With
    no stability switch set (and no decision of it in the checkpoint) none of the layer's modules is imported."""
    return stability.build_callbacks(cfg, writer, saved_state) or training.NO_CALLBACKS
