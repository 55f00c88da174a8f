"""Optimizer side of stablegpt: AdamW (ours, or bitsandbytes 8-bit), the learning-rate schedule,
fp16 loss scaling and the gradient utilities (clipping, overflow check).

Everything here is local to one process. What ranks must agree on (the global grad norm, the zero count) is in
parallel.py, which degenerates to the plain computation with one process.
"""

import math

import torch

# -----------------------------------------------------------------------------
# AdamW


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay, same math as torch.optim.AdamW:

        p  *= 1 - lr * wd
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g^2
        p  -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

    The step counter lives in each parameter's state, so it is saved by state_dict() and restored by
    load_state_dict(). Lesson 7: apex FusedAdam kept it outside the state, every resume restarted the
    bias correction at step 1 and the first updates after a resume were up to 2.2x too large.

    With lr = 0 the moments (and the step counter) advance but the weights stay bit-identical: that is
    the optimizer-reset warm-up of lesson 8 (fresh moments, N = 5 / (1 - beta2) iterations at lr 0).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if lr < 0.0:
            raise ValueError(f"AdamW: learning rate must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {tuple(betas)}")
        if weight_decay < 0.0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamW does not support sparse gradients; use a dense nn.Embedding")
                state = self.state[p]
                if len(state) == 0:
                    # moments in the parameter's dtype: fp32 master weights get fp32 moments
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue

            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]

            # decoupled weight decay: shrink the weights first, independently of the gradient
            # (with lr = 0 this multiplies by exactly 1.0)
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)

            # moments: m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

            # bias corrections from each parameter's own (restored) step counter
            bias_correction1 = [1.0 - beta1**step for step in steps]
            bias_correction2_sqrt = [math.sqrt(1.0 - beta2**step) for step in steps]

            # p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / bc for bc in bias_correction1])
            del denom

        return loss


# -----------------------------------------------------------------------------
# parameter groups and optimizer construction


def param_groups(model: torch.nn.Module, weight_decay: float, params=None) -> list:
    """Megatron's rule: biases and LayerNorm weights (every parameter with ndim < 2) get no weight
    decay; linear weights and embeddings do. Empty groups are left out. params: only these (a ZeRO shard)."""
    decay, no_decay = [], []
    keep = None if params is None else set(params)
    for p in model.parameters():  # shared (tied) parameters are listed once
        if not p.requires_grad or (keep is not None and p not in keep):
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def decay_coefficient(weight_decay, lr, independent=False):
    """AdamW's weight_decay for a decay of `weight_decay` per step, lr being the peak LR of the schedule.

    Coupled (torch, Megatron): each step multiplies the weights by 1 - lr_t * weight_decay, so across an LR grid
    the decay per step varies as much as the LR. Independent (Loshchilov & Hutter's Algorithm 2; Wortsman et al.
    2023, 3.2.2): by 1 - s_t * weight_decay, with s_t = lr_t / lr the schedule's multiplier (warm-up and decay
    included), whatever the LR. That is coupled decay with the coefficient weight_decay / lr."""
    if not independent:
        return weight_decay
    return weight_decay / lr if lr > 0 else 0.0


def build_optimizer(model, lr, weight_decay, adam_beta1, adam_beta2, adam_eps, use_bnb_optimizer=False, embedding=None,
                    params=None, independent_decay=False):
    """Our AdamW, or bitsandbytes' 8-bit AdamW with `embedding` (the token embedding weight) kept in
    32-bit optimizer state, as bitsandbytes' StableEmbedding requires (lesson 14). params: only these of the
    model's parameters (a ZeRO-1 shard), default all. independent_decay: see decay_coefficient."""
    weight_decay = decay_coefficient(weight_decay, lr, independent_decay)
    groups = param_groups(model, weight_decay, params)
    betas = (adam_beta1, adam_beta2)
    if not use_bnb_optimizer:
        return AdamW(groups, lr=lr, betas=betas, eps=adam_eps, weight_decay=weight_decay)

    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or its native library does not load on this machine
        raise ValueError(f"use_bnb_optimizer needs bitsandbytes, whose import fails ({type(e).__name__}: {e}); "
                         "`pip install bitsandbytes`, or unset use_bnb_optimizer") from None

    manager = bnb.optim.GlobalOptimManager.get_instance()
    # The manager is a process-wide dict keyed by id(param). A freed parameter's id can be reused by
    # one of ours, so first drop whatever it holds for our parameters, then set the one override.
    for p in model.parameters():
        manager.pid2config.pop(id(p), None)
    if embedding is not None:
        manager.override_config(embedding, "optim_bits", 32)
    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=adam_eps, weight_decay=weight_decay)


def set_lr(optimizer, lr: float) -> None:
    """The one place the learning rate is written into the param groups (train_step, the DeepSpeed step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# -----------------------------------------------------------------------------
# gradient utilities (local to this rank; the trainer all-reduces)


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def clip_grads(params, max_norm: float, total_norm) -> None:
    """Scale the gradients by min(1, max_norm / (total_norm + 1e-6)), Megatron's clipping rule.
    total_norm is the global (all-reduced) norm; as a tensor it is used without a host sync."""
    if max_norm <= 0.0:
        return
    grads = _grads(params)
    if not grads:
        return
    if not torch.is_tensor(total_norm):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float32)
    clip_coeff = (max_norm / (total_norm.float() + 1.0e-6)).clamp(max=1.0)
    # multiplying by exactly 1.0 when no clipping is needed leaves the gradients bit-identical
    torch._foreach_mul_(grads, clip_coeff.to(grads[0].device))


def grads_finite(params) -> bool:
    """False if any gradient holds an inf or a nan. A sum propagates both, so one fp32 L1-norm reduction
    per tensor answers it without an elementwise mask (like DeepSpeed's check, a sum beyond the fp32
    range, ~3e38, also counts as an overflow)."""
    grads = [g for g in _grads(params) if g.numel() > 0]
    if not grads:
        return True
    l1 = torch._foreach_norm(grads, 1, dtype=torch.float32)
    return bool(torch.stack(l1).isfinite().all())


# -----------------------------------------------------------------------------
# learning-rate schedule


class AnnealingLR:
    """Megatron-DeepSpeed's AnnealingLR (lesson 23) as a function of consumed samples and
    tokens. Megatron's "steps" are consumed samples.

    - warm-up: by samples (lr = max_lr * samples / warmup_samples while samples <= warmup_samples) or,
      when warmup_tokens is set, by tokens;
    - decay by samples, or by tokens when decay_tokens is set (used with curriculum learning, where a
      sample's length varies). Token decay runs from the token count at the end of warm-up, which is
      only known once it happens, so it is remembered and saved in state_dict();
    - "constant": max_lr after warm-up; "linear"/"cosine": min_lr + coeff * (max_lr - min_lr);
      past the decay end: min_lr.

    Megatron records the warm-up-end token count only at a call with samples == warmup exactly, and
    keeps 0 when the batch sizes never land on it (the lr then drops at the end of warm-up). We record
    it at the first call with samples >= warmup, which is the same when they do land on it.

    Note: Megatron and DeepSpeed advance the schedule only on applied (not skipped) iterations, so the
    samples a caller passes should exclude iterations skipped for an fp16 overflow to reproduce their
    logs (lesson 5; the tr8b-104B log at iteration 6502: 5.997E-05 at 216960 consumed samples fits a
    731-738 sample lag).
    """

    STYLES = ("linear", "cosine", "constant")

    def __init__(self, max_lr, min_lr, decay_style, warmup_samples=0, decay_samples=None,
                 warmup_tokens=None, decay_tokens=None):
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.decay_style = decay_style
        self.warmup_samples = int(warmup_samples or 0)
        self.decay_samples = None if decay_samples is None else int(decay_samples)
        self.warmup_tokens = None if warmup_tokens is None else int(warmup_tokens)
        self.decay_tokens = None if decay_tokens is None else int(decay_tokens)
        self._validate()

        # token count at the end of warm-up: fixed by the config for a token warm-up or no warm-up,
        # remembered when it happens for a sample warm-up (None until then)
        self.warmup_end_tokens = self._configured_warmup_end_tokens()

    def _configured_warmup_end_tokens(self):
        if self.warmup_tokens is not None:
            return self.warmup_tokens
        return 0 if self.warmup_samples == 0 else None

    def _validate(self):
        fix = "check lr, min_lr, lr_decay_style, lr_warmup_samples/tokens and lr_decay_samples/tokens"
        if self.decay_style not in self.STYLES:
            raise ValueError(f"unknown lr_decay_style {self.decay_style!r}; use one of {', '.join(self.STYLES)}")
        if self.min_lr < 0.0 or self.max_lr < 0.0:
            raise ValueError(f"learning rates must be >= 0 (lr {self.max_lr}, min_lr {self.min_lr}); {fix}")
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr {self.min_lr} is larger than lr {self.max_lr}; lower min_lr or raise lr")
        if self.warmup_samples < 0:
            raise ValueError(f"lr_warmup_samples must be >= 0, got {self.warmup_samples}")
        if self.warmup_tokens is not None:
            if self.warmup_samples > 0:
                raise ValueError("both lr_warmup_samples and lr_warmup_tokens are set; set only one of them")
            if self.warmup_tokens < 0:
                raise ValueError(f"lr_warmup_tokens must be >= 0, got {self.warmup_tokens}")
            if self.decay_tokens is None and self.decay_style != "constant":
                raise ValueError("lr_warmup_tokens needs lr_decay_tokens (a token warm-up and a sample decay "
                                 "have no common origin); set lr_decay_tokens or use lr_warmup_samples")
        if self.decay_tokens is not None:
            warmup = self.warmup_tokens or 0
            if self.decay_tokens <= warmup:
                raise ValueError(f"lr_decay_tokens ({self.decay_tokens}) must be larger than the warm-up "
                                 f"({warmup} tokens); {fix}")
        elif self.decay_style != "constant" and self.decay_samples is None:
            raise ValueError(f"lr_decay_style {self.decay_style!r} needs lr_decay_samples (or lr_decay_tokens)")
        if self.decay_samples is not None and self.decay_samples <= self.warmup_samples:
            raise ValueError(f"lr_decay_samples ({self.decay_samples}) must be larger than lr_warmup_samples "
                             f"({self.warmup_samples}); {fix}")

    def get_lr(self, consumed_samples: int, consumed_tokens: int) -> float:
        if self.warmup_tokens is None and self.warmup_samples > 0:
            # remember the token count where the sample warm-up ends; while it has not ended nothing is
            # remembered (so a count restored from a checkpoint with another warm-up cannot stick)
            if consumed_samples <= self.warmup_samples:
                self.warmup_end_tokens = None
            if self.warmup_end_tokens is None and consumed_samples >= self.warmup_samples:
                self.warmup_end_tokens = consumed_tokens

        # linear warm-up
        if self.warmup_tokens is not None:
            if self.warmup_tokens > 0 and consumed_tokens <= self.warmup_tokens:
                return self.max_lr * consumed_tokens / self.warmup_tokens
        elif self.warmup_samples > 0 and consumed_samples <= self.warmup_samples:
            return self.max_lr * consumed_samples / self.warmup_samples

        if self.decay_style == "constant":
            return self.max_lr

        if self.decay_tokens is None:
            if consumed_samples > self.decay_samples:
                return self.min_lr
            ratio = (consumed_samples - self.warmup_samples) / (self.decay_samples - self.warmup_samples)
        else:
            if consumed_tokens >= self.decay_tokens:  # ratio 1 gives min_lr too; >= avoids 0/0 when
                return self.min_lr                    # the warm-up ended at or past decay_tokens
            start = self.warmup_end_tokens
            ratio = (consumed_tokens - start) / (self.decay_tokens - start)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"lr decay ratio {ratio} outside [0, 1] at {consumed_samples} samples / "
                             f"{consumed_tokens} tokens (warm-up ended at {self.warmup_end_tokens} tokens); "
                             f"the consumed counters went backwards, check the checkpoint")

        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def describe(self) -> str:
        if self.warmup_tokens is not None:
            warmup = f"warm-up {self.warmup_tokens} tokens"
        else:
            warmup = f"warm-up {self.warmup_samples} samples"
        if self.decay_style == "constant":
            decay = "then constant"
        elif self.decay_tokens is not None:
            decay = f"{self.decay_style} decay to {self.decay_tokens} tokens"
        else:
            decay = f"{self.decay_style} decay to {self.decay_samples} samples"
        return f"lr schedule: max_lr {self.max_lr}, min_lr {self.min_lr}, {warmup}, {decay}"

    # the quantities a resume must agree on, with the names Megatron prints
    _CHECKED = (
        ("max_lr", "learning rate"),
        ("min_lr", "minimum learning rate"),
        ("warmup_samples", "warm-up samples"),
        ("warmup_tokens", "warm-up tokens"),
        ("decay_samples", "decay samples"),
        ("decay_tokens", "decay tokens"),
        ("decay_style", "decay style"),
    )

    def state_dict(self) -> dict:
        sd = {key: getattr(self, key) for key, _ in self._CHECKED}
        sd["warmup_end_tokens"] = self.warmup_end_tokens
        return sd

    def load_state_dict(self, sd: dict, override: bool) -> None:
        """Without override the checkpoint's schedule must equal the config's (lesson 10: changing min_lr
        on resume was refused with an assertion). With override the config's hyper-parameters win and
        the lr follows them from the current consumed samples/tokens.

        The remembered warm-up-end token count is restored for a sample warm-up. When an override
        changed that warm-up: if the new warm-up has not ended yet, get_lr() forgets the restored count
        and records the true one when it ends; if it ended in the past, its token count was never seen
        and the checkpoint's count (the end of the old warm-up) is kept as the best estimate. For a
        token warm-up or none, the config fixes it (warmup_tokens, or 0)."""
        mismatches = [
            f"class input value {getattr(self, key)} and checkpoint value {sd.get(key)} for {name} do not match"
            for key, name in self._CHECKED
            if getattr(self, key) != sd.get(key)
        ]
        if mismatches and not override:
            raise ValueError("AnnealingLR: " + "; ".join(mismatches) + "; to use the config's schedule from "
                             "the current consumed samples/tokens, set override_lr_scheduler "
                             "(--override-lr-scheduler)")
        self.warmup_end_tokens = self._configured_warmup_end_tokens()
        if self.warmup_end_tokens is None:
            self.warmup_end_tokens = sd.get("warmup_end_tokens")


# -----------------------------------------------------------------------------
# fp16 loss scaling


class LossScaler:
    """fp16 loss scaling with Megatron/DeepSpeed semantics (lesson 5).

    Dynamic: on an overflow the step is skipped, the clean-step counter restarts and the hysteresis
    counter drops by one; once it is used up every overflow halves the scale (not below min_scale).
    After `window` clean steps in a row the scale doubles and the hysteresis is restored. Lesson 5's log shows
    the first overflow keeping 1048576.0 and the following ones halving it.

    Static (static_scale given, or dynamic=False): the scale never changes. LossScaler(dynamic=False,
    static_scale=1.0) is the no-op scaler for fp32/bf16.
    """

    def __init__(self, dynamic=True, initial_scale=2.0**32, min_scale=1.0, window=1000, hysteresis=2,
                 static_scale=None):
        self.dynamic = bool(dynamic) and static_scale is None
        self.scale = float(static_scale if static_scale is not None else initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        if self.scale <= 0.0:
            raise ValueError(f"loss scale must be > 0, got {self.scale}")
        if self.dynamic:
            if not 0.0 < self.min_scale <= self.scale:
                raise ValueError(f"min_loss_scale {self.min_scale} must be in (0, initial_loss_scale {self.scale}]")
            if self.window < 1 or self.hysteresis < 1:
                raise ValueError(f"loss_scale_window ({self.window}) and hysteresis ({self.hysteresis}) must be >= 1")
        self.clean_steps = 0  # clean (no overflow) steps since the last overflow or growth
        self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool):
        """Call once per iteration, after checking the gradients. Returns the log line for a skipped
        step, or None."""
        if not self.dynamic:
            if overflow:
                return f"OVERFLOW! Skipping step. Attempted loss scale: {self.scale}, static so not reduced"
            return None
        if overflow:
            attempted = self.scale
            self.clean_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return f"OVERFLOW! Skipping step. Attempted loss scale: {attempted}, reducing to {self.scale}"
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0
        return None

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        # a static scale is configuration, not state: the config's value stays
        if not self.dynamic:
            return
        self.scale = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])
        self.hysteresis_left = int(sd["hysteresis_left"])
