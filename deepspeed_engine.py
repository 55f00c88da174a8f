"""DeepSpeed behind the optimizer interface of the trainer: ZeRO and bf16 master weights, nothing else.

    # builders.build_deepspeed, deepspeed=True (zero_stage: the layout's, micro_batch_size: the
    # schedule's)
    model, optimizer = deepspeed_engine.initialize(optim_cfg, model, optimizer, zero_stage,
                                                   micro_batch_size)
    # training.train_step, after backward
    loss, grad_norm, num_zeros, outcome = optimizer.finish_step(loss, lr)

Tensor and pipeline parallelism, the micro-batch loop, the loss average, the LR schedule, checkpoints and the
tied-embedding reduction stay ours; the model stays our GPT, and backward is plain autograd. DeepSpeed brings
the bf16 weights' fp32 master copy, the data-parallel reduction, the sharding of the optimizer state (ZeRO-1)
and of the gradients (ZeRO-2), the grad norm, clipping and the update.

Which DeepSpeed 0.19 optimizer runs, and why:
- bf16, zero_stage 0 or 1: BF16_Optimizer, BigScience's for BLOOM-176B (lesson 6). Each micro-batch's bf16
  gradient is added into an fp32 buffer as soon as autograd produces it (`immediate_grad_update`), the fp32
  buffers are all-reduced over DP (`communication_data_type` fp32), the fp32 master weights and Adam moments
  are sharded over DP. DeepSpeed picks it only for ZeRO-1 (for ZeRO-0 it would pick an optimizer that sums
  and all-reduces the gradients in bf16 and, keeping only fp32 copies of the parameters, counts TP-split
  weights on one TP rank and the tied embedding twice in the grad norm), so zero_stage=0 runs as ZeRO-1 --
  as BLOOM-176B ran "ZeRO stage 0" with bf16.
- bf16, zero_stage 2: DeepSpeedZeroOptimizer with fp32 gradient partitions and fp32 reduce-scatter.
- fp32, zero_stage 1 or 2: DeepSpeedZeroOptimizer.
ZeRO-2 reduces and partitions gradients during each micro-batch's backward, through hooks that the engine's
forward arms: under ZeRO-2 the model to run is the engine (parallel.unwrap finds our GPT inside).
The grad norm counts each parameter once, as parallel.grad_norm does: DeepSpeed reads `tensor_model_parallel`
(TP-split: every TP rank's share; replicated: TP rank 0's) and `ds_pipe_replicated` (the last stage's copy of
the tied embedding: not counted), which are set on our parameters below.
"""

import math
import os

import torch
import torch.distributed as dist

import optim
import parallel


def check(optim_cfg, zero_stage, grid):
    """The configurations DeepSpeed does not run as the native path would: one message each, before the slow
    `import deepspeed`. optim_cfg: the optimizer's keys (optim.OptimizerConfig); zero_stage: the
    layout's."""
    if optim_cfg.fp16:
        raise ValueError(
            "deepspeed=True with fp16 is not supported: DeepSpeed would take over loss scaling (and "
            "its CPU build refuses fp16); use bf16, or fp16 with deepspeed=False (native ZeRO-1 too)"
        )
    if zero_stage == 0 and not optim_cfg.bf16:
        raise ValueError(
            "deepspeed=True with zero_stage=0 and fp32 adds nothing to the native path; set "
            "zero_stage to 1 or 2, or bf16, or deepspeed=False"
        )
    problem = parallel.zero_stage_problem(zero_stage, True, grid.pp_size)
    if problem is not None:
        raise ValueError(problem)
    if optim_cfg.skip_grad_norm_above is not None:
        raise ValueError(
            "skip_grad_norm_above needs the grad norm before the update, which DeepSpeed computes "
            "inside its step(); unset it or use deepspeed=False"
        )
    # 8-bit AdamW is refused here: it quantizes each parameter on its own and keeps the embedding's
    # state 32-bit (lesson 14), which DeepSpeed's flat buffers would mix up
    name = optim.name(optim_cfg)
    if not optim.OPTIMIZERS[name].elementwise:
        given = "use_bnb_optimizer" if optim_cfg.use_bnb_optimizer else f"optimizer={name!r}"
        raise ValueError(
            f"{given} with deepspeed=True is not supported: DeepSpeed hands the "
            "optimizer flat buffers that mix many parameters, which "
            f"{name} does not take (optim.OPTIMIZERS[{name!r}].elementwise is "
            "False: only an elementwise update can); use deepspeed=False: the "
            "native path, zero_stage=1 included, hands the optimizer whole parameters"
        )


def zero_stage_run(bf16, zero_stage):
    """The ZeRO stage DeepSpeed runs for the config's zero_stage: with bf16, 0 runs as 1 (BF16_Optimizer, see
    above); what ds_config asks for, and what estimate.py sizes."""
    return 1 if bf16 and zero_stage == 0 else zero_stage


def ds_config(optim_cfg, zero_stage, grid, micro_batch_size):
    """The DeepSpeed config: one micro-batch per step() as far as DeepSpeed knows (we run the micro-batches and
    divide the loss ourselves), no loss scaling, fp32 gradient accumulation and reduction under bf16."""
    bf16 = optim_cfg.bf16
    bf16_zero1 = bf16 and zero_stage < 2
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * grid.dp_size,
        # step() is the accumulation boundary: backward only accumulates, step() reduces and updates
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim_cfg.clip_grad,
        "zero_optimization": {
            "stage": zero_stage_run(bf16, zero_stage),
            "elastic_checkpoint": False,
        },
        "bf16": {"enabled": bf16, "immediate_grad_update": bf16_zero1},
        "zero_allow_untested_optimizer": True,  # our AdamW is not on DeepSpeed's list
        "steps_per_print": 2**62,
    }
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    return config


class DeepSpeedMPU:
    """Our grid in the shape of Megatron's `mpu` module. It is how DeepSpeed learns the DP group (to shard the
    optimizer over and reduce gradients in) and the model-parallel group (TP x PP: to sum the grad norm over)."""

    def __init__(self, g):
        self.g = g

    def get_data_parallel_group(self):
        return self.g.dp_group

    def get_data_parallel_rank(self):
        return self.g.dp_rank

    def get_data_parallel_world_size(self):
        return self.g.dp_size

    def get_model_parallel_group(self):
        return self.g.mp_group

    def get_model_parallel_rank(self):
        return self.g.pp_rank * self.g.tp_size + self.g.tp_rank

    def get_model_parallel_world_size(self):
        return self.g.tp_size * self.g.pp_size

    def get_tensor_model_parallel_group(self):
        return self.g.tp_group

    def get_tensor_model_parallel_rank(self):
        return self.g.tp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.g.tp_size

    def get_pipeline_model_parallel_group(self):
        return self.g.pp_group

    def get_pipeline_model_parallel_rank(self):
        return self.g.pp_rank

    def get_pipeline_model_parallel_world_size(self):
        return self.g.pp_size


def initialize(optim_cfg, model, optimizer, zero_stage, micro_batch_size):
    """(the model to run, the optimizer to step) for deepspeed=True. optim_cfg: the optimizer's keys
    (optim.OptimizerConfig); zero_stage (the layout's) and micro_batch_size (the schedule's): see
    ds_config."""
    wrapper = DeepSpeedOptimizer(optim_cfg, model, optimizer, zero_stage, micro_batch_size)
    return (wrapper.engine if zero_stage == 2 else model), wrapper


class DeepSpeedOptimizer:
    """Our optimizer handed to DeepSpeed, with the interface train.py uses: param_groups (the LR is written
    there every step), zero_grad, state_dict / load_state_dict, refresh_fp32_params, and finish_step."""

    def __init__(self, optim_cfg, model, optimizer, zero_stage, micro_batch_size):
        g = parallel.grid
        check(optim_cfg, zero_stage, g)
        # DeepSpeed's accelerator and the process group's backend follow the model's device (configured by
        # `device`), not torch.cuda.is_available(): device=cpu on a GPU machine stays on the CPU with gloo.
        on_cuda = next(model.parameters()).is_cuda
        # read at DeepSpeed's first use
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")
        # one process (python train.py): DeepSpeed still wants a process group
        if not dist.is_initialized():
            os.environ.setdefault("LOCAL_RANK", "0")
            dist.init_process_group(
                "nccl" if on_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
            g = parallel.init(g.tp_size, g.pp_size)  # one process: TP = PP = 1
        import deepspeed

        for p in model.parameters():
            p.tensor_model_parallel = getattr(p, "tp_dim", None) is not None
        if model.output_weight is not None:
            model.output_weight.ds_pipe_replicated = True
        # model_parameters is left out: DeepSpeed then takes the optimizer's param groups (weight decay and all)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            mpu=DeepSpeedMPU(g),
            config=ds_config(optim_cfg, zero_stage, g, micro_batch_size),
            dist_init_required=False,
        )
        self.model, self.dp_size = model, g.dp_size
        self.tied = not model.config.untie_embeddings_and_output_weights
        # no optimizer step may happen before ours
        if any(s.get("step", 0) for s in optimizer.state.values()):
            raise RuntimeError(
                f"{type(self.optimizer).__name__} stepped the optimizer at construction"
            )
        if optim_cfg.bf16 and zero_stage < 2 and g.rank == 0:
            print(
                f"DeepSpeed bf16, zero_stage={zero_stage}: {type(self.optimizer).__name__}, "
                "fp32 gradient "
                f"accumulation and DP all-reduce, fp32 master weights and Adam moments sharded over DP="
                f"{g.dp_size} (ZeRO-1)",
                flush=True,
            )

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def gradient(self, p):
        """Where DeepSpeed accumulates p's gradient: BF16_Optimizer's fp32 buffer, or p.grad."""
        buffers = getattr(self.optimizer, "fp32_groups_gradients", None)
        if buffers is None:
            return p.grad
        for group, params in zip(buffers, self.optimizer.bf16_groups):
            for grad, q in zip(group, params):
                if q is p:
                    return grad.view(p.shape)
        raise KeyError("parameter not held by DeepSpeed's optimizer")

    def finish_step(self, loss, lr):
        """The end of train_step: DeepSpeed's step() reduces over DP, computes the grad norm, clips and updates
        in one call, so the norm is known only afterwards and "num zeros" is not available (logged as 0)."""
        g = parallel.grid
        if self.tied and g.pp_size > 1 and (g.is_first_stage or g.is_last_stage):
            # the tied embedding's two copies' gradients summed: identical copies, identical updates (lesson 11);
            # an untied output layer is a parameter of the last stage alone, with nothing to sum
            tied = self.model.word_embedding_weight()
            grad = self.gradient(tied)
            if grad is None:
                grad = tied.grad = torch.zeros_like(tied)
            dist.all_reduce(grad, group=g.embedding_group)
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return loss, float("nan"), 0, "nan"  # a NaN loss never updates the weights
        optim.set_lr(self.optimizer, lr)
        skipped = self.engine.skipped_steps
        self.engine.step()
        grad_norm = float(self.engine.get_global_grad_norm())
        return loss, grad_norm, 0, "skipped" if self.engine.skipped_steps > skipped else "ok"

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        """This rank's state from its own rank file. ZeRO picks the shard from a list indexed by DP rank; the
        fp32 master weights come from the checkpoint, not from the (bf16) model weights, which would round them."""
        self.optimizer.load_state_dict([state] * self.dp_size, load_from_fp32_weights=True)

    def refresh_fp32_params(self):
        """A fresh optimizer (no_load_optim): the fp32 master weights from the loaded model weights."""
        self.optimizer.refresh_fp32_params()

    def close(self):
        """DeepSpeed's engine released (its hooks, buffers and groups) before the process groups go."""
        self.engine.destroy()
