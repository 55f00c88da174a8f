"""Optimizer side of stablegpt: the optimizers a run chooses from (OPTIMIZERS: our AdamW,
bitsandbytes' 8-bit AdamW, a fork's own), fp16 loss scaling and gradient clipping. The learning
rate of each step is schedule.py's.

Everything here is local to one process. What ranks must agree on (the global grad norm, the zero count) is in
parallel.py, which degenerates to the plain computation with one process. optimizer_for and scaler_for build a
run's from its config: the optimizer `optimizer` names, inside precision.py's fp32 master weights,
sharded over DP by parallel.py (ZeRO-1). A new optimizer is a class and one entry of OPTIMIZERS
(docs/forking.md).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import parallel
import precision
import schedule

# -----------------------------------------------------------------------------
# The optimizer's keys and the precision's, and their checks (arguments.Config is made of each owner's keys)


@dataclass
class OptimizerConfig:
    # -- optimizer --
    optimizer: str | None = None  # OPTIMIZERS' name: adamw | adamw8bit | a fork's; None: adamw
    weight_decay: float = 0.01  # decoupled weight decay (not on biases and LayerNorms)
    # decay weight_decay x lr_t/lr per step, not x lr_t: same at any LR
    weight_decay_independent: bool = False
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's epsilon
    override_adam_params: bool = False  # on resume, this config's values of the optimizer's keys
    clip_grad: float = 1.0  # clip the global gradient norm to this
    use_bnb_optimizer: bool = False  # the shortcut for optimizer="adamw8bit" (bitsandbytes)
    # skip the update when the grad norm exceeds this (OPT)
    skip_grad_norm_above: float | None = None
    # -- precision: half-precision weights, fp32 masters, fp16's loss scaling (precision.py, optim.LossScaler) --
    # fp16 weights and activations, fp32 master weights, dynamic loss scaling (precision.py)
    fp16: bool = False
    # bf16 weights and activations, fp32 master weights and gradient accumulation
    bf16: bool = False
    loss_scale: float | None = None  # static fp16 loss scale; None: dynamic
    initial_loss_scale: float = 2.0**32  # first dynamic loss scale
    min_loss_scale: float = 1.0  # the dynamic loss scale never goes below this
    loss_scale_window: int = 1000  # double the loss scale after this many steps without overflow
    hysteresis: int = 2  # overflows tolerated before the loss scale is halved

    # keys read only while a switch is on (sections.py): bf16 and fp32 scale no loss; only a resume loads Adam
    SWITCHED = {
        "fp16": (
            "loss_scale",
            "initial_loss_scale",
            "min_loss_scale",
            "loss_scale_window",
            "hysteresis",
        ),
        "load|save": ("override_adam_params",),
    }


# The dynamic loss scaler's keys, which a static loss_scale leaves unread (scaler_for)
DYNAMIC_SCALE_KEYS = ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
# Keys of which a config gives one, refused together by check(): one given on the command line replaces the
# config file's other one (arguments.load_config)
EXCLUSIVE = (("fp16", "bf16"),) + tuple(("loss_scale", key) for key in DYNAMIC_SCALE_KEYS)


def check(optim_cfg):
    """Raise ValueError with the fix for optimizer or precision keys that cannot work."""
    name(optim_cfg)  # a known optimizer, and use_bnb_optimizer not contradicting it
    for key in ("weight_decay", "clip_grad"):
        if getattr(optim_cfg, key) < 0:
            raise ValueError(f"{key}={getattr(optim_cfg, key)} must not be negative")
    bound = optim_cfg.skip_grad_norm_above
    # at 0 or below, every update was skipped: a run that never moved and exited 0
    _need(
        bound is None or bound > 0,
        f"skip_grad_norm_above={bound} must be positive (a grad norm; OPT's 1.0 on its scale), or None (off)",
    )
    if optim_cfg.fp16 and optim_cfg.bf16:
        raise ValueError("fp16 and bf16 are exclusive; choose one")
    # the optimizer's constructor and LossScaler refuse these too, but only once the model is built
    for key, usual in (("adam_beta1", "0.9"), ("adam_beta2", "0.95 for large runs")):
        beta = getattr(optim_cfg, key)
        _need(0 <= beta < 1, f"{key}={beta} must be in [0, 1) ({usual})")
    _need(
        optim_cfg.adam_eps >= 0,
        f"adam_eps={optim_cfg.adam_eps} must not be negative (1e-8)",
    )
    _check_loss_scale(optim_cfg)


def _check_loss_scale(optim_cfg):
    """fp16's loss-scaling keys in their ranges, whether fp16 is on or not: no value outside them means anything."""
    static, initial, floor = (
        optim_cfg.loss_scale,
        optim_cfg.initial_loss_scale,
        optim_cfg.min_loss_scale,
    )
    _need(
        static is None or static > 0,
        f"loss_scale={static} must be positive (a static fp16 loss scale), or None for the dynamic one",
    )
    _need(
        initial > 0,
        f"initial_loss_scale={initial} must be positive (2**32; the 104B's: 4096)",
    )
    _need(
        0 < floor <= initial,
        f"min_loss_scale={floor} must be positive and at most initial_loss_scale={initial:g} (1)",
    )
    dynamic = [
        f"{key}={getattr(optim_cfg, key)!r}"
        for key in DYNAMIC_SCALE_KEYS
        if getattr(optim_cfg, key) != OptimizerConfig.__dataclass_fields__[key].default
    ]
    _need(
        static is None or not dynamic,
        f"loss_scale={static} is a static loss scale, which never changes: {', '.join(dynamic)} "
        "(the dynamic scale's) would be ignored; drop loss_scale for the dynamic scale, or drop "
        f"{'it' if len(dynamic) == 1 else 'them'}",
    )
    for key, what in (
        ("loss_scale_window", "clean steps before the loss scale doubles; the 104B's: 500"),
        ("hysteresis", "overflows tolerated before the loss scale halves; 2"),
    ):
        value = getattr(optim_cfg, key)
        _need(value >= 1, f"{key}={value} must be at least 1 ({what})")


def _need(ok, message):
    """Raise ValueError(message) unless ok."""
    if not ok:
        raise ValueError(message)


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
    The update is torch's fused AdamW kernel (torch.optim.AdamW(fused=True), bitwise): one pass over the fp32
    masters and their moments instead of the eight of multi-tensor foreach ops, the same numbers to rounding.
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
                    raise ValueError(
                        "AdamW does not support sparse gradients; use a dense nn.Embedding"
                    )
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

            beta1, beta2 = group["betas"]
            # One fused kernel per (device, dtype): torch.optim.AdamW(fused=True)'s, on CUDA and CPU alike. It
            # reads each parameter's step from a tensor: one per distinct count (usually one), filled on the device
            # (torch.full: no host-to-device copy, no sync); the integer counter in the state stays the truth.
            counts = {}
            by_kind = {}
            for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                key = (p.device, step)
                if key not in counts:
                    counts[key] = torch.full((), float(step), device=p.device)
                lists = by_kind.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for into, t in zip(lists, (p, g, m, v, counts[key])):
                    into.append(t)
            for p, g, m, v, step in by_kind.values():
                torch._fused_adamw_(
                    p,
                    g,
                    m,
                    v,
                    [],
                    step,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )
        return loss


# -----------------------------------------------------------------------------
# The registry: the optimizers a run chooses from by name (`optimizer = "adamw"`, as Megatron's
# --optimizer), each built by its entry from the config keys it declares


def adamw8bit(groups, tables=(), **hyper):
    """bitsandbytes' 8-bit AdamW, the vocabulary-sized `tables` (the token embedding, an untied
    output layer) kept in 32-bit optimizer state, as bitsandbytes' StableEmbedding requires
    (lesson 14)."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or its native library does not load on this machine
        raise ValueError(
            f"optimizer='adamw8bit' or use_bnb_optimizer needs bitsandbytes, whose "
            f"import fails ({type(e).__name__}: {e}); `pip install bitsandbytes`, or "
            "choose another optimizer"
        ) from None
    manager = bnb.optim.GlobalOptimManager.get_instance()
    # The manager is a process-wide dict keyed by id(param). A freed parameter's id can be reused by
    # one of ours, so first drop whatever it holds for our parameters, then set the one override.
    for p in [p for group in groups for p in group["params"]] + list(tables):
        manager.pid2config.pop(id(p), None)
    for weight in tables:
        manager.override_config(weight, "optim_bits", 32)
    return bnb.optim.AdamW8bit(groups, **hyper)


ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_eps")


def adam_options(beta1, beta2, eps):
    return {"betas": (beta1, beta2), "eps": eps}


def adam_bound(beta1, beta2, eps=None):
    """The most one Adam step can move a weight, in units of its learning rate (before weight
    decay): by Cauchy-Schwarz, |m_hat| / sqrt(v_hat) <= (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2
    / beta2)) whatever the gradients (clipped or not) and the step (with a = beta1^t, b = beta2^t,
    the bias corrections only lower it: (1 - b)(1 - a^2 / b) <= (1 - a)^2 as b + a^2 / b >= 2a);
    7.3 at (0.9, 0.999), 1.2 at (0.9, 0.95); no bound when beta1^2 >= beta2. eps only lowers it."""
    if beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def adam_reset_iters(beta1, beta2, eps=None):
    """The lr=0 iterations Adam's fresh moments need after a reset (lesson 8): its second
    moment's, 5 / (1 - beta2)."""
    return schedule.moment_warmup_iters(beta2)


@dataclass(frozen=True)
class OptimizerEntry:
    """How a run builds one optimizer from its config. The keys keep Megatron's names (adam_beta1,
    ...) on the command line, in config files and in checkpoints, where the schedule's and the
    stability layer's rules read them too; an entry declares which of them it reads, and a resume
    compares those."""

    make: Callable  # make(groups, lr=, weight_decay=, **options(...)) -> a torch.optim.Optimizer
    keys: tuple = ()  # the config keys it reads besides lr and weight_decay, in options' order
    options: Callable = dict  # options(*values of keys) -> make's keywords, also its groups' keys
    # True: its update is elementwise, so it may run on DeepSpeed's flat buffers (ZeRO's partitions,
    # which mix many parameters); the others are refused with deepspeed=True
    elementwise: bool = False
    tables: bool = False  # make also gets tables=: the vocabulary-sized weights, to treat apart
    # What the run's rules need of its update, functions of the values of keys, as options is
    # (None: not declared). step_bound: the most one step can move a weight, in units of its LR
    # (the spike guard's test for a weight something else wrote; none declared: no such test).
    # reset_iters: the lr=0 iterations its fresh state needs after a reset, what
    # reset_optimizer_warmup_iters="auto" stands for (none declared: "auto" refused).
    step_bound: Callable | None = None
    reset_iters: Callable | None = None


ADAM_RULES = dict(step_bound=adam_bound, reset_iters=adam_reset_iters)
OPTIMIZERS = {
    "adamw": OptimizerEntry(AdamW, ADAM_KEYS, adam_options, elementwise=True, **ADAM_RULES),
    # quantized in blocks along each parameter, the embedding's state 32-bit: whole parameters only
    "adamw8bit": OptimizerEntry(adamw8bit, ADAM_KEYS, adam_options, tables=True, **ADAM_RULES),
}
BNB = "adamw8bit"  # what use_bnb_optimizer is the shortcut for


def optimizer_name(optimizer=None, use_bnb_optimizer=False):
    """The entry of OPTIMIZERS that `optimizer` and its shortcut use_bnb_optimizer name: None is
    adamw, or adamw8bit with use_bnb_optimizer; another name beside use_bnb_optimizer is refused."""
    if use_bnb_optimizer and optimizer not in (None, BNB):
        raise ValueError(
            f"use_bnb_optimizer asks for optimizer={BNB!r} but "
            f"optimizer={optimizer!r}; unset one of them (use_bnb_optimizer is the "
            f"shortcut for {BNB})"
        )
    chosen = optimizer or (BNB if use_bnb_optimizer else "adamw")
    if chosen not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={chosen!r} is not one of {', '.join(OPTIMIZERS)}; pick one, "
            "or register a fork's own in optim.OPTIMIZERS (docs/forking.md)"
        )
    return chosen


def name(optim_cfg):
    """The optimizer a run's config chooses."""
    return optimizer_name(optim_cfg.optimizer, optim_cfg.use_bnb_optimizer)


def key_values(optim_cfg):
    """The config values of the keys the chosen optimizer's entry reads, in its order."""
    return [getattr(optim_cfg, key) for key in OPTIMIZERS[name(optim_cfg)].keys]


def step_bound(optim_cfg):
    """The most one step of the chosen optimizer can move a weight, in units of its LR (its entry's
    step_bound at this config's values), or None when its entry declares none."""
    entry = OPTIMIZERS[name(optim_cfg)]
    return None if entry.step_bound is None else entry.step_bound(*key_values(optim_cfg))


def reset_due(warmup_iters, saved_state):
    """Is lesson 8's reset due at this resume: asked for (reset_warmup_iters' count), and the
    checkpoint's run (saved_state: its run state) not reset yet? Then its optimizer state is not
    loaded (run_state.load), nor checked against this config (safety.check_optimizer_state)."""
    return bool(warmup_iters) and saved_state.get("optimizer_reset") is None


def reset_warmup_iters(optim_cfg, setting, unset=None):
    """The lr=0 iterations after an optimizer reset (lesson 8): setting,
    reset_optimizer_warmup_iters, where "auto" is the iterations the chosen optimizer's fresh state
    needs (its entry's reset_iters: Adam's 5 / (1 - adam_beta2)); 0 without one. `unset`: the
    setting when the config has none (the spike guard resets with "auto"). "auto" under an entry
    that declares no reset_iters is refused: no number would mean anything."""
    given = setting or unset
    if not given:
        return 0
    if given != "auto":
        return int(given)
    chosen = name(optim_cfg)
    entry = OPTIMIZERS[chosen]
    if entry.reset_iters is None:
        how = "" if setting else " (unset: what spike_guard_reset_optimizer resets with)"
        raise ValueError(
            f"reset_optimizer_warmup_iters='auto'{how} is the lr=0 iterations the optimizer's "
            f"state needs after a reset, which optimizer={chosen!r} does not declare (its "
            f"OPTIMIZERS entry has no reset_iters): give reset_optimizer_warmup_iters a count "
            "of iterations (e.g. 100), or declare reset_iters in its entry"
        )
    return entry.reset_iters(*key_values(optim_cfg))


def checkpoint_optimizer(saved_config):
    """The optimizer whose state a checkpoint holds, from its run's config (a dict). The migration:
    a checkpoint written before the registry has no `optimizer` key, and the rule of name() reads
    it, adamw or, with use_bnb_optimizer, adamw8bit. A fork's optimizer this code lacks is still
    named."""
    bnb = saved_config.get("use_bnb_optimizer")
    return saved_config.get("optimizer") or (BNB if bnb else "adamw")


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


def build_optimizer(
    model,
    lr,
    weight_decay,
    *values,
    optimizer=None,
    use_bnb_optimizer=False,
    embedding=None,
    params=None,
    independent_decay=False,
):
    """OPTIMIZERS[optimizer] (default adamw; use_bnb_optimizer: adamw8bit) over param_groups(model);
    values: the config values of its entry's keys, in order (AdamW's: adam_beta1, adam_beta2,
    adam_eps). embedding: the token embedding weight, or a list of it and an untied output layer
    (the vocabulary-sized tables, which an entry with tables=True treats apart). params: only these
    of the model's parameters (a ZeRO-1 shard), default all. independent_decay: see
    decay_coefficient."""
    entry = OPTIMIZERS[optimizer_name(optimizer, use_bnb_optimizer)]
    if len(values) != len(entry.keys):
        raise TypeError(f"build_optimizer: {len(values)} values for the keys {entry.keys}")
    weight_decay = decay_coefficient(weight_decay, lr, independent_decay)
    groups = param_groups(model, weight_decay, params)
    extra = {}
    if entry.tables:
        extra["tables"] = [embedding] if torch.is_tensor(embedding) else list(embedding or [])
    return entry.make(groups, lr=lr, weight_decay=weight_decay, **extra, **entry.options(*values))


def set_lr(optimizer, lr: float) -> None:
    """The one place the learning rate is written into the param groups (train_step, the DeepSpeed step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def resume_adam_params(optimizer, optim_cfg, saved_config) -> str | None:
    """After a resume has loaded the optimizer state (run_state.load), before any step: the param
    groups hold the checkpoint's values (torch's load_state_dict; a resharded state is built on
    this run's groups); with override_adam_params this config's are written into them, the state
    kept (Adam's beta2 changed mid-run: a what-if fork). Returns the line to print."""
    what = adam_changes(optim_cfg, saved_config)
    if what is None:
        return None
    entry = OPTIMIZERS[name(optim_cfg)]
    decay_now = decay_coefficient(
        optim_cfg.weight_decay, optim_cfg.lr, optim_cfg.weight_decay_independent
    )
    options = entry.options(*(getattr(optim_cfg, key) for key in entry.keys))
    for group in optimizer.param_groups:
        group.update(options)
        if group.get("name") == "decay":
            group["weight_decay"] = decay_now
    return f"override_adam_params: {what} from now on (the optimizer's moments kept)"


def adam_changes(optim_cfg, saved_config) -> str | None:
    """What of the optimizer's settings this config changes from the checkpoint's run (saved_config), as
    "key old -> new, ..."; None if nothing. Refused: a checkpoint of another optimizer (its state holds
    other tensors: AdamW stepping Lion's dies with a KeyError on its missing 'step'), and changed keys
    without override_adam_params. Checked before the build (safety.resolve_resume) and at the load."""
    saved, now = checkpoint_optimizer(saved_config), name(optim_cfg)
    if saved != now:
        raise ValueError(
            f"the checkpoint's optimizer state is {saved}'s, but this run's "
            f"optimizer is {now}, which cannot continue from it; resume with "
            f"optimizer={saved!r}, or set no_load_optim to start {now} from a fresh "
            "state (the weights are loaded)"
        )
    entry = OPTIMIZERS[now]
    # the decay groups' coefficient, which the param groups hold too: weight_decay, and the peak lr under
    # independent decay (weight_decay / lr)
    decay_keys = ("weight_decay", "weight_decay_independent", "lr")
    changed = {
        k: (saved_config[k], getattr(optim_cfg, k))
        for k in (*entry.keys, *decay_keys)
        if k in saved_config and saved_config[k] != getattr(optim_cfg, k)
    }
    decay_now = decay_coefficient(
        optim_cfg.weight_decay, optim_cfg.lr, optim_cfg.weight_decay_independent
    )
    if all(k in saved_config for k in decay_keys):
        decay_then = decay_coefficient(
            *(saved_config[k] for k in ("weight_decay", "lr", "weight_decay_independent"))
        )
    else:
        decay_then = decay_now  # an older checkpoint's config: what its keys were is not known
    # lr alone, under coupled decay: the schedule's business (override_lr_scheduler)
    if decay_then == decay_now:
        changed = {k: v for k, v in changed.items() if k not in decay_keys}
    if not changed:
        return None
    what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
    if not optim_cfg.override_adam_params:
        raise ValueError(
            f"the checkpoint's optimizer has other Adam settings than this config ({what}): a resumed "
            "optimizer keeps its checkpoint's; set override_adam_params to use this config's from now on "
            "(the moments are kept), or resume with the checkpoint's values"
        )
    return what


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

    def __init__(
        self,
        dynamic=True,
        initial_scale=2.0**32,
        min_scale=1.0,
        window=1000,
        hysteresis=2,
        static_scale=None,
    ):
        self.dynamic = bool(dynamic) and static_scale is None
        self.scale = float(static_scale if static_scale is not None else initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        if self.scale <= 0.0:
            raise ValueError(f"loss scale must be > 0, got {self.scale}")
        if self.dynamic:
            if not 0.0 < self.min_scale <= self.scale:
                raise ValueError(
                    f"min_loss_scale {self.min_scale} must be in (0, initial_loss_scale {self.scale}]"
                )
            if self.window < 1 or self.hysteresis < 1:
                raise ValueError(
                    f"loss_scale_window ({self.window}) and hysteresis ({self.hysteresis}) must be >= 1"
                )
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
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, sd: dict) -> None:
        # a static scale is configuration, not state: the config's value stays
        if not self.dynamic:
            return
        self.scale = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])
        self.hysteresis_left = int(sd["hysteresis_left"])


# -----------------------------------------------------------------------------
# Built from a run's config


def optimizer_for(optim_cfg, model, lr, deepspeed=False, zero_stage=0):
    """The optimizer `optimizer` names, over fp32 master weights
    (precision.MixedPrecisionOptimizer), sharded over DP with zero_stage=1. Under DeepSpeed, the
    bare optimizer: DeepSpeed keeps the masters and shards them itself. lr: the schedule's peak
    learning rate (independent weight decay divides by it); deepspeed, zero_stage: the layout's."""
    # this stage's vocabulary tables: the tied embedding's copy, and an untied output layer (the last stage's)
    embedding = [w for w in (model.word_embedding_weight(), model.output_layer) if w is not None]
    chosen, given = name(optim_cfg), key_values(optim_cfg)

    def build(params):
        optimizer = build_optimizer(
            model,
            lr,
            optim_cfg.weight_decay,
            *given,
            optimizer=chosen,
            embedding=embedding,
            params=params,
            independent_decay=optim_cfg.weight_decay_independent,
        )
        return optimizer if deepspeed else precision.MixedPrecisionOptimizer(optimizer)

    if deepspeed or zero_stage == 0 or parallel.grid.dp_size == 1:
        # not sharded here (under DeepSpeed, deepspeed_engine shards it)
        return build(list(model.parameters()))
    problem = parallel.zero_stage_problem(zero_stage, False, parallel.grid.pp_size)
    if problem is not None:
        raise ValueError(problem)
    return parallel.ZeroShardedOptimizer(model.parameters(), build)


def scaler_for(optim_cfg):
    """The loss scaler: fp16's dynamic one (or a static loss_scale); a scale of 1 that never changes otherwise."""
    if not optim_cfg.fp16:
        return LossScaler(dynamic=False, static_scale=1.0)
    if optim_cfg.loss_scale is not None:
        return LossScaler(dynamic=False, static_scale=optim_cfg.loss_scale)
    return LossScaler(
        dynamic=True,
        initial_scale=optim_cfg.initial_loss_scale,
        min_scale=optim_cfg.min_loss_scale,
        window=optim_cfg.loss_scale_window,
        hysteresis=optim_cfg.hysteresis,
    )
