"""What fp16 and bf16 mean: Megatron's mixed-precision regime, as the 104B (fp16) and 176B (bf16) ran it (lesson 6).

    what                                                 fp32     bf16     fp16     where
    model weights, activations, residual stream          fp32     bf16     fp16     builders.build_model
    pipeline messages (activations and their gradients)  fp32     bf16     fp16     parallel.pipeline_forward_backward
    LayerNorm statistics, softmax, cross-entropy         fp32     fp32     fp32     model.norm, core_attention,
                                                                                    vocab_parallel_cross_entropy
    gradient accumulation over micro-batches, DP mean    fp32     fp32     fp32     parallel.GradBuffer
    master weights, Adam moments (sharded by ZeRO-1)     fp32     fp32     fp32     MixedPrecisionOptimizer below
    loss scaling (dynamic, OVERFLOW lines, lesson 5)      -        -       yes      optim.LossScaler
    checkpoint                                           the model in its dtype + the fp32 master weights

Each micro-batch's gradients come out of backward in the half dtype (fp16's scaled by the loss scale) and are
summed in fp32, fp16's too (Megatron's accumulate_allreduce_grads_in_fp32, which its fp16 runs left off): an fp16
sum of 256 micro-batches is off by 1.9e-3 (relative, simulated in issue 39) against 5.2e-4 at the 104B's 16, and
64 micro-batches of a tiny model summed in fp16 were off by 1.8e-3 where the fp32 sum is within 1e-6
(tests/test_precision.py). The fp32 sum is unscaled in place for the update; an overflow (inf or NaN in any
micro-batch's gradient) stays inf or NaN in it, and in the grad norm the loss scaler reads. The cost: 4 bytes per
parameter for the buffer instead of 2, less the fp32 copy of fp16 gradients that the update no longer takes (4
bytes per parameter of this rank's ZeRO-1 share): 2 - 4/DP bytes per parameter in all (none at DP <= 2, the 104B's
DP; estimate.bytes_per_parameter). With fp16, apply_query_key_layer_scaling is on unless set (Megatron's default;
arguments.derive).

There is no autocast: weights are stored in the compute dtype, so what runs is what Megatron ran, and the
half-precision rounding of the residual stream (a source of the 104B's spikes) is reproduced, not hidden.
"""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def name(optim_cfg):
    """fp16, bf16 or fp32, of optim_cfg's fp16 and bf16 (keys of optim.OptimizerConfig)."""
    return "fp16" if optim_cfg.fp16 else "bf16" if optim_cfg.bf16 else "fp32"


def compute_dtype(optim_cfg):
    """The dtype of the weights and activations."""
    return DTYPES[name(optim_cfg)]


def grad_dtype(optim_cfg):
    """The dtype gradients are accumulated and all-reduced in: fp32 in every precision (see above)."""
    return torch.float32


class MixedPrecisionOptimizer:
    """An optimizer over fp32 master copies of half-precision parameters (Megatron's
    Float16OptimizerWithFloat16Params); for fp32 parameters the master is the parameter itself (its FP32Optimizer).

    Built around an optimizer of the model's parameters, it swaps each half parameter in the param groups for an
    fp32 copy, so the optimizer's state (Adam's moments, bitsandbytes' 8-bit state) lives on the copies. A step:
    prepare_grads() gives every master its model parameter's accumulated gradient in fp32, unscaled (a view of
    the fp32 GradBuffer, unscaled in place; an fp32 copy of a half .grad where there is no buffer);
    the caller clips; step() updates the masters and rounds them into the model's weights. state_dict() adds the
    masters to the optimizer's state, so a checkpoint resumes from fp32 weights, bit-exactly."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.model_params, self.main_params = [], []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                main = p
                if p.dtype != torch.float32:
                    main = torch.nn.Parameter(p.detach().float())
                    group["params"][i] = main
                    optimizer.state.pop(p, None)
                    # bitsandbytes finds a parameter's overrides (the embedding's 32-bit state, lesson 14) by id
                    overrides = getattr(getattr(optimizer, "mng", None), "pid2config", {})
                    if id(p) in overrides:
                        overrides[id(main)] = overrides[id(p)]
                self.model_params.append(p)
                self.main_params.append(main)
        self.copies = [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not p]
        self._main = dict(zip(self.model_params, self.main_params))

    def main_param(self, p):
        """The fp32 master this optimizer steps for model parameter p (p itself if fp32; None if not held here)."""
        return self._main.get(p)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        for p in self.main_params:
            p.grad = None

    def prepare_grads(self, loss_scale=1.0):
        """Point each master's .grad at its model parameter's gradient in fp32, divided by loss_scale. Returns the
        master parameters (the ones to clip and step)."""
        grads = []
        for p, main in zip(self.model_params, self.main_params):
            grad = getattr(p, "main_grad", p.grad)
            # no copy when it is fp32 already
            main.grad = None if grad is None else grad.to(torch.float32)
            if main.grad is not None:
                grads.append(main.grad)
        if loss_scale != 1.0 and grads:
            torch._foreach_div_(grads, loss_scale)
        return self.main_params

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        for p, main in self.copies:
            p.copy_(main)

    def state_dict(self):
        state = self.optimizer.state_dict()
        if self.copies:
            state["fp32_master_weights"] = [main.detach() for _, main in self.copies]
        return state

    def load_state_dict(self, state):
        state = dict(state)
        masters = state.pop("fp32_master_weights", None)
        if self.copies and (masters is None or len(masters) != len(self.copies)):
            raise ValueError(
                "the optimizer state in the checkpoint has no fp32 master weights for this model's "
                "half-precision parameters (saved with another precision?); resume with the same "
                "fp16/bf16 setting, or set no_load_optim to start the masters from the weights"
            )
        self.optimizer.load_state_dict(state)
        with torch.no_grad():
            for (p, main), saved in zip(self.copies, masters or []):
                main.copy_(saved)
                p.copy_(main)

    @torch.no_grad()
    def refresh_fp32_params(self):
        """Masters from the model's weights (a fresh optimizer after a load without its state)."""
        for p, main in self.copies:
            main.copy_(p)
