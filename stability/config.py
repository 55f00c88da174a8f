"""The stability layer's keys and their checks: the spike guard (lesson 21), the soft skip, telemetry, the skip list
and fault injection. arguments.Config is made of each owner's keys; this file is the stability layer's part.

Each callback of the layer reads its own section of the config once, when it is built: a small dataclass below
whose fields are the keys it reads, by their names (section()).

The dependency runs from this layer to the core, never back: the checks below use the core's rules
(schedule.parse_iteration_ranges), and stability.precursors is imported inside check() only.
"""
import math
from dataclasses import dataclass, fields

import schedule


@dataclass
class StabilityConfig:
    # -- stability: the soft skip, telemetry, the skip list, the spike guard (lesson 21), fault injection --
    soft_skip_loss_ratio: float = 0.0  # loss > this x its trend: gradients x trend/loss before clipping (0: off)
    telemetry_interval: int = 0  # per-layer grad/param/update norms, activations, logits every N iterations (0: off)
    dp_replica_check_interval: int | None = None  # checksum the DP replicas' state every N iters (None: guard's)
    skip_documents: str | None = None  # a skip list (<save>/skip_documents.jsonl): no sample takes its documents
    spike_guard: bool = False  # skip a spiking step; if it persists roll back and skip data; on a relapse lower the LR
    spike_guard_window: int = 128  # applied steps in the trailing loss / grad-norm statistics (OLMo-core: 128)
    spike_guard_min_steps: int = 16  # applied steps recorded before it judges (its own warm-up; the LR's need not end)
    spike_guard_zscore: float = 6.0  # a spike: loss or grad norm this many spreads above its trend's prediction ...
    spike_guard_ema_ratio: float = 1.1  # ... and above this multiple of the predicted value
    spike_guard_grad_norm_ratio: float = 100.0  # ... or the grad norm this multiple (a clean tiny run: lone 12x jumps)
    spike_guard_rise_steps: int = 3  # ... or the loss this many steps in a row over half that zscore (0: off)
    spike_guard_unseen_interval: int = 10  # ... or far below an unseen batch's loss, measured every N iters (0: off)
    spike_guard_update_ratio: float = 4.0  # the weights' move per update this x its trend, at each snapshot (0: off)
    spike_guard_max_skips: int = 3  # spikes (or NaN/inf steps) within spike_guard_rewind iterations before a rollback
    spike_guard_rewind: int = 100  # roll back to before (first spike - this) and skip the data from there ...
    spike_guard_skip_after: int = 200  # ... to this many iterations after the last spike (PaLM: 200-500 in all)
    spike_guard_snapshot_interval: int = 50  # a CPU copy of the run every N iterations to roll back to (0: disk only)
    spike_guard_snapshot_dir: str | None = None  # node-local disk ($SLURM_TMPDIR): snapshots there, not in host memory
    spike_guard_lr_factor: float = 0.5  # on a relapse (a second rollback), multiply the LR by this from then on
    spike_guard_reset_optimizer: bool = False  # on a relapse, also reset the optimizer with the lr=0 warm-up (lesson 8)
    spike_guard_max_rollbacks: int = 3  # more would be needed: save the last good state and exit (code 3)
    spike_guard_max_skipped_iters: int = 2000  # iterations skipped by the guard in all, then save and exit (code 3)
    spike_guard_max_hardware_faults: int = 3  # transient faults on one DP rank before the run stops, naming it
    spike_guard_max_numerical: int = 4  # numerical diagnoses in spike_guard_rewind iterations: persistent, stop
    spike_guard_fp32_replay: bool = True  # fp16/bf16: replay a reproduced spike in fp32 (an fp32 copy of the weights)
    spike_guard_precursor: str | None = None  # EXPERIMENTAL early rung (None: off): cut the LR when this passes ...
    spike_guard_precursor_threshold: float | None = None  # ... this threshold (docs/spike_guard.md, section 7)
    spike_guard_precursor_lr_factor: float = 0.5  # ... by this factor, once per crossing (precursors.PRECURSORS)
    # -- stability: the field's remedies, baselines for the guard (stability/remedies.py; docs/spike_guard.md) --
    skip_step_sigma: float = 0.0  # OLMo-core's SkipStep: skip a step > this many stds above the window (6; 0: off)
    skip_step_window: int = 128  # ... the previous steps' losses and grad norms it is judged against (OLMo-core: 128)
    spiky_loss_factor: float = 0.0  # Megatron's spiky loss: a loss >= this x the largest seen is re-run (10; 0: off)
    spiky_loss_samples: int = 100  # ... the first steps whose largest loss is the bar (Megatron: 100)
    zclip_z: float = 0.0  # ZClip: clip a grad norm whose z-score over its EMA is above this (2.5; 0: off)
    zclip_alpha: float = 0.97  # ... the EMA's smoothing factor (ZClip: 0.97)
    zclip_warmup: int = 25  # ... grad norms collected before the EMA starts (ZClip: 25)
    # the automated checkpoint restarts (remedies.OptRestart, PalmRestart; 0: off): on a spike,
    opt_restart_lr_factor: float = 0.0  # OPT's: back to the last checkpoint, the LR x this (0.25)
    palm_restart_skip: int = 0  # PaLM's: back palm_restart_back iterations, skip this many (200)
    palm_restart_back: int = 100  # ... to the newest checkpoint this far before the spike (PaLM)
    restart_sigma: float = 6.0  # their spike: the loss this many stds above the window's mean ...
    restart_window: int = 128  # ... of these previous steps (OLMo-core's SkipStep rule: 6, 128)
    restart_max: int = 3  # restarts in a run, then none (spike_guard_max_rollbacks' default)
    inject_bad_batch_iters: list[str] | None = None  # fault injection: iterations ("40-45") given random-token batches
    inject_lr_iters: list[str] | None = None  # fault injection: iteration ranges whose LR is x inject_lr_factor
    inject_lr_factor: float = 100.0  # the LR multiplier of inject_lr_iters
    inject_lr_persistent: bool = False  # inject_lr_iters on every pass (a resume with a higher LR), not once in time
    inject_degenerate_iters: list[str] | None = None  # fault injection: iterations given degenerate batches ...
    inject_degenerate_kind: str = "repeat"  # ... one token repeated ("repeat"), an 8-gram ("ngram"), or "minority":
    inject_degenerate_fraction: float = 0.25  # ... random tokens in this fraction of the samples
    inject_bitflip_iters: list[str] | None = None  # fault injection: flip a bit of one gradient element at these iters
    inject_bitflip_rank: int = 0  # ... on this rank, after the DP all-reduce (a faulty GPU: silent data corruption)
    inject_bitflip_target: str = "grad"  # ... of a gradient ("grad"), a weight, "exp_avg", "exp_avg_sq" or "master"
    inject_bitflip_bit: int = -1  # ... this bit of the element (-1: the top exponent bit)
    inject_bitflip_element: int = -1  # ... this element of the first matrix (-1: its largest in magnitude)
    inject_numerical_iters: list[str] | None = None  # fault injection: a cancellation only half precision loses
    inject_lost_optimizer_state_iter: int | None = None  # fault injection: Adam's moments zeroed before this step
    inject_repeat_iters: list[str] | None = None  # fault injection: a block of repeated documents in corpus order ...
    inject_repeat_period: int = 1  # ... its iterations given again the samples of its first this many iterations
    inject_overflow_iters: list[str] | None = None  # fault injection (fp16): gradients overflow
    inject_bad_samples: list[str] | None = None  # fault injection: sample ranges ("0-7") bad in the corpus ...
    inject_bad_samples_kind: str = "random"  # ... random tokens, "repeat", "ngram" or "duplicate" ...
    inject_duplicate_period: int = 8  # ... of the range's first this many samples, in turn
    inject_bad_device_iter: int | None = None  # fault injection: inject_bitflip_rank's device bad from here on


def need(ok, message):
    if not ok:
        raise ValueError(message)


def check(cfg):
    """Raise ValueError with the fix for stability keys that cannot work."""
    check_faults(cfg)
    need(cfg.dp_replica_check_interval is None or cfg.dp_replica_check_interval >= 0,
         "dp_replica_check_interval must be 0 (off), a number of iterations, or None (with spike_guard: its "
         "spike_guard_snapshot_interval)")
    need(cfg.spike_guard_update_ratio == 0 or cfg.spike_guard_update_ratio > 1,
         "spike_guard_update_ratio must be 0 (off) or above 1: a move per update that many times its trend's")
    need(cfg.spike_guard_unseen_interval >= 0, "spike_guard_unseen_interval must be >= 0 (0 turns it off)")
    need(cfg.telemetry_interval >= 0, "telemetry_interval must be >= 0 (0 turns telemetry off)")
    need(not (cfg.deepspeed and cfg.telemetry_interval), "telemetry_interval needs the gradients before the "
         "update, which DeepSpeed keeps inside its step(); set telemetry_interval=0 or deepspeed=False")
    need(not (cfg.deepspeed and cfg.spike_guard), "spike_guard judges the loss and grad norm before the update, "
         "which DeepSpeed computes inside its step(); set spike_guard=False or deepspeed=False")
    need(cfg.spike_guard_window >= 2 and 2 <= cfg.spike_guard_min_steps <= cfg.spike_guard_window,
         "spike_guard_min_steps must be in [2, spike_guard_window]")
    need(cfg.spike_guard_zscore > 0 and cfg.spike_guard_ema_ratio >= 1 and cfg.spike_guard_grad_norm_ratio >= 1,
         "spike_guard_zscore must be > 0, spike_guard_ema_ratio and spike_guard_grad_norm_ratio >= 1")
    need(cfg.spike_guard_rise_steps == 0 or 2 <= cfg.spike_guard_rise_steps <= cfg.spike_guard_window,
         "spike_guard_rise_steps must be 0 (off) or in [2, spike_guard_window]: one step over half the zscore is a "
         "clean run's noise, and the series keeps spike_guard_window steps")
    need(cfg.spike_guard_max_skips >= 1 and cfg.spike_guard_rewind >= 0 and cfg.spike_guard_skip_after >= 0,
         "spike_guard_max_skips must be >= 1, spike_guard_rewind and spike_guard_skip_after >= 0")
    need(cfg.spike_guard_snapshot_interval >= 0, "spike_guard_snapshot_interval must be >= 0 (0: disk checkpoints)")
    need(not cfg.spike_guard or cfg.spike_guard_snapshot_interval or cfg.save,
         "spike_guard with spike_guard_snapshot_interval=0 rolls back to disk checkpoints: set save and save_interval")
    need(not cfg.spike_guard_snapshot_dir or cfg.spike_guard_snapshot_interval,
         "spike_guard_snapshot_dir holds the snapshots of spike_guard_snapshot_interval: set an interval (e.g. 50)")
    if cfg.spike_guard_snapshot_dir:
        check_directory(cfg.spike_guard_snapshot_dir, "spike_guard_snapshot_dir")
    need(0 < cfg.spike_guard_lr_factor <= 1, "spike_guard_lr_factor must be in (0, 1]")
    need(cfg.soft_skip_loss_ratio == 0 or cfg.soft_skip_loss_ratio >= 1,
         f"soft_skip_loss_ratio={cfg.soft_skip_loss_ratio} must be 0 (off) or >= 1 (a multiple of the loss's trend)")
    need(not (cfg.deepspeed and cfg.soft_skip_loss_ratio), "soft_skip_loss_ratio scales the gradients before the "
         "update, which DeepSpeed keeps inside its step(); set soft_skip_loss_ratio=0 or deepspeed=False")
    need(cfg.spike_guard_max_hardware_faults >= 1, "spike_guard_max_hardware_faults must be >= 1")
    need(cfg.spike_guard_max_numerical >= 1,
         "spike_guard_max_numerical must be >= 1 (the numerical diagnoses before a stop)")
    if cfg.spike_guard_precursor is not None:
        from stability.precursors import PRECURSORS
        need(cfg.spike_guard_precursor in PRECURSORS,
             f"spike_guard_precursor={cfg.spike_guard_precursor!r} is not one of {', '.join(PRECURSORS)}")
        need(cfg.spike_guard_precursor_threshold is not None and math.isfinite(cfg.spike_guard_precursor_threshold),
             "spike_guard_precursor needs spike_guard_precursor_threshold (a number: docs/spike_guard.md has the "
             "thresholds measured on the stability lab's clean runs; tools/precursors.py measures yours)")
        need(cfg.telemetry_interval > 0, "spike_guard_precursor reads the telemetry: set telemetry_interval (e.g. 10)")
    need(cfg.spike_guard_precursor is not None or cfg.spike_guard_precursor_threshold is None,
         "spike_guard_precursor_threshold does nothing without spike_guard_precursor: set "
         "spike_guard_precursor (docs/spike_guard.md, section 7) or leave the threshold out")
    need(0 < cfg.spike_guard_precursor_lr_factor <= 1, "spike_guard_precursor_lr_factor must be in (0, 1]")
    check_remedies(cfg)


def check_faults(cfg):
    """Fault injection's keys: ranges, targets, bits and the precision a fault needs."""
    for key in ("inject_bad_batch_iters", "inject_lr_iters", "inject_bitflip_iters",
                "inject_numerical_iters", "inject_degenerate_iters", "inject_repeat_iters",
                "inject_overflow_iters"):
        schedule.parse_iteration_ranges(getattr(cfg, key), key)
    need(cfg.inject_bitflip_target in ("grad", "weight", "exp_avg", "exp_avg_sq", "master"),
         "inject_bitflip_target must be 'grad', 'weight', or the optimizer's 'exp_avg', "
         "'exp_avg_sq' or 'master'")
    width = bitflip_width(cfg)
    need(-1 <= cfg.inject_bitflip_bit < width,
         f"inject_bitflip_bit={cfg.inject_bitflip_bit} is not a bit of the {width}-bit element "
         f"it flips (inject_bitflip_target={cfg.inject_bitflip_target}): give 0-{width - 1}, "
         "or -1 for the top exponent bit")
    need(cfg.inject_lost_optimizer_state_iter is None or cfg.inject_lost_optimizer_state_iter >= 1,
         "inject_lost_optimizer_state_iter must be an iteration (>= 1), or None (off)")
    need(cfg.inject_degenerate_kind in ("repeat", "ngram", "minority"),
         f"inject_degenerate_kind={cfg.inject_degenerate_kind!r} must be 'repeat', 'ngram' or "
         "'minority'")
    need(0 < cfg.inject_degenerate_fraction < 1,
         "inject_degenerate_fraction must be in (0, 1): a minority's share")
    need(not cfg.inject_overflow_iters or cfg.fp16,
         "inject_overflow_iters makes fp16's gradients overflow: set fp16 (bf16 and fp32 have "
         "fp32's range)")
    need(cfg.inject_repeat_period >= 1,
         "inject_repeat_period must be >= 1 (the iterations whose samples repeat)")
    sample_ranges(cfg.inject_bad_samples, "inject_bad_samples")
    need(cfg.inject_bad_samples_kind in SAMPLE_KINDS,
         f"inject_bad_samples_kind={cfg.inject_bad_samples_kind!r} must be one of "
         f"{', '.join(SAMPLE_KINDS)}")
    need(cfg.inject_duplicate_period >= 1,
         "inject_duplicate_period must be >= 1 (the samples a duplicate block repeats)")
    need(cfg.inject_bad_device_iter is None or cfg.inject_bad_device_iter >= 1,
         "inject_bad_device_iter must be an iteration (>= 1), or None (off)")


SAMPLE_KINDS = ("random", "repeat", "ngram", "duplicate")  # inject_bad_samples_kind's names


def sample_ranges(ranges, key):
    """["0-7", "96-99"] -> [(0, 7), (96, 99)]: consumed-sample indices (0-based, inclusive: the
    first sample of the run is 0, as loader.sample_indices counts them)."""
    return schedule.parse_iteration_ranges(
        ranges, key, lowest=0, unit="consumed-sample indices, 0-based and inclusive, e.g. 96-103")


def bitflip_width(cfg):
    """The width in bits of the element inject_bitflip_target flips: a weight is in the run's
    precision (fp16, bf16: 16 bits); gradients (accumulated in fp32: precision.grad_dtype), Adam's
    moments and the masters are fp32."""
    return 16 if cfg.inject_bitflip_target == "weight" and (cfg.fp16 or cfg.bf16) else 32


def check_directory(path, key):
    """A directory the run will create (or use) at `path`: refused, naming the key, when it cannot
    be -- the path or its nearest existing parent is not a directory, or that parent is not
    writable -- before any work is done (else a bare errno when the run first writes there)."""
    import os
    path = os.path.abspath(path)
    if os.path.exists(path):
        need(os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK),
             f"{key}={path} is "
             + ("not a directory" if not os.path.isdir(path) else "not writable")
             + ": give a directory the run can write (a node-local disk, e.g. $SLURM_TMPDIR)")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    need(os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK),
         f"{key}={path} cannot be created: {parent} is "
         + ("a file, not a directory" if not os.path.isdir(parent) else "not writable")
         + "; give a directory the run can create or write (a node-local disk, e.g. $SLURM_TMPDIR)")


def check_remedies(cfg):
    """The field's remedies (stability/remedies.py): their keys' ranges."""
    remedies = [k for k in ("skip_step_sigma", "spiky_loss_factor", "zclip_z") if getattr(cfg, k)]
    need(not (cfg.deepspeed and remedies), f"{', '.join(remedies)} judge the loss and grad norm before the update, "
         "which DeepSpeed computes inside its step(); set them to 0 or deepspeed=False")
    need(cfg.skip_step_sigma >= 0 and cfg.skip_step_window >= 4,
         "skip_step_sigma must be >= 0 (0: off) and skip_step_window >= 4 (its warm-up is half of it, >= 2 steps)")
    need(cfg.spiky_loss_factor == 0 or cfg.spiky_loss_factor > 1,
         f"spiky_loss_factor={cfg.spiky_loss_factor} must be 0 (off) or > 1 (a multiple of the largest loss seen)")
    need(cfg.spiky_loss_samples >= 1, "spiky_loss_samples must be >= 1 (the steps whose largest loss is the bar)")
    need(cfg.zclip_z >= 0 and 0 < cfg.zclip_alpha < 1 and cfg.zclip_warmup >= 2,
         "zclip_z must be >= 0 (0: off), zclip_alpha in (0, 1) and zclip_warmup >= 2 (a variance needs 2 values)")
    check_restarts(cfg)


def check_restarts(cfg):
    """The automated checkpoint restarts (remedies.OptRestart, PalmRestart): ranges, and the disk
    checkpoints they go back to."""
    need(0 <= cfg.opt_restart_lr_factor < 1,
         f"opt_restart_lr_factor={cfg.opt_restart_lr_factor} must be 0 (off) or in (0, 1): a "
         "restart at the same LR would replay the spike (OPT's seeds: x0.25)")
    need(cfg.palm_restart_skip >= 0 and cfg.palm_restart_back >= 0,
         "palm_restart_skip (0: off; PaLM: 200-500) and palm_restart_back (PaLM: ~100) must be "
         ">= 0")
    need(cfg.restart_sigma > 0 and cfg.restart_window >= 4 and cfg.restart_max >= 1,
         "restart_sigma must be > 0, restart_window >= 4 (its warm-up is half of it) and "
         "restart_max >= 1")
    on = [k for k in ("opt_restart_lr_factor", "palm_restart_skip") if getattr(cfg, k)]
    if not on:
        return
    need(len(on) == 1, "opt_restart_lr_factor and palm_restart_skip are two baselines: set one "
         "of them to 0")
    need(not cfg.spike_guard, f"{on[0]} is a baseline the spike guard is compared with, and both "
         f"would roll the run back: set spike_guard=False or {on[0]}=0")
    need(not cfg.deepspeed, f"{on[0]} judges the loss before the update, which DeepSpeed "
         "computes inside its step(); set it to 0 or deepspeed=False")
    need(cfg.save and cfg.save_interval, f"{on[0]} restarts from the run's disk checkpoints: set "
         "save=DIR and save_interval (e.g. 100)")


# -----------------------------------------------------------------------------
# Each callback's section: the keys it reads, by their names


def section(cls, cfg):
    """The dataclass cls filled from cfg: each field the key of its name, read once."""
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class DetectorConfig:  # detector.Detector: what a spike is
    spike_guard_window: int
    spike_guard_min_steps: int
    spike_guard_zscore: float
    spike_guard_ema_ratio: float
    spike_guard_grad_norm_ratio: float
    spike_guard_rise_steps: int
    spike_guard_unseen_interval: int
    spike_guard_update_ratio: float
    clip_grad: float  # the grad norm's stand-in bar before it has a trend


@dataclass(frozen=True)
class LadderConfig:  # spike_guard.SpikeGuard: what a spike calls for
    spike_guard: bool
    spike_guard_max_skips: int
    spike_guard_rewind: int
    spike_guard_skip_after: int
    spike_guard_snapshot_interval: int  # how far back the LRs a rollback would replay are kept
    spike_guard_lr_factor: float
    spike_guard_reset_optimizer: bool
    spike_guard_max_rollbacks: int
    spike_guard_max_skipped_iters: int
    spike_guard_max_hardware_faults: int
    spike_guard_max_numerical: int


@dataclass(frozen=True)
class PrecursorConfig:  # spike_guard.precursor_rung
    spike_guard_precursor: str | None
    spike_guard_precursor_threshold: float | None
    spike_guard_precursor_lr_factor: float
    adam_eps: float  # grad_rms_over_eps is measured against it


@dataclass(frozen=True)
class SoftSkipConfig:  # soft_skip.SoftSkip
    soft_skip_loss_ratio: float
    spike_guard_min_steps: int  # the trend is the guard's line, over as many steps as the guard needs
    spike_guard_window: int


@dataclass(frozen=True)
class SkipStepConfig:  # remedies.SkipStep
    skip_step_sigma: float
    skip_step_window: int


@dataclass(frozen=True)
class SpikyLossConfig:  # remedies.SpikyLoss
    spiky_loss_factor: float
    spiky_loss_samples: int


@dataclass(frozen=True)
class ZClipConfig:  # remedies.ZClip
    zclip_z: float
    zclip_alpha: float
    zclip_warmup: int


@dataclass(frozen=True)
class RestartConfig:  # remedies.OptRestart, remedies.PalmRestart
    opt_restart_lr_factor: float
    palm_restart_skip: int
    palm_restart_back: int
    restart_sigma: float
    restart_window: int
    restart_max: int


@dataclass(frozen=True)
class FaultsConfig:  # faults.Faults
    inject_bad_batch_iters: list | None
    inject_lr_iters: list | None
    inject_lr_factor: float
    inject_lr_persistent: bool
    inject_degenerate_iters: list | None
    inject_degenerate_kind: str
    inject_degenerate_fraction: float
    inject_bitflip_iters: list | None
    inject_bitflip_rank: int
    inject_bitflip_target: str
    inject_bitflip_bit: int
    inject_bitflip_element: int
    inject_numerical_iters: list | None
    inject_lost_optimizer_state_iter: int | None
    inject_bad_samples: list | None
    inject_bad_samples_kind: str
    inject_duplicate_period: int
    inject_bad_device_iter: int | None
    inject_repeat_iters: list | None
    inject_repeat_period: int
    inject_overflow_iters: list | None
    seed: int  # the faults' generators are seeded by (seed, iteration)
    vocab_size: int  # random tokens are drawn from it


@dataclass(frozen=True)
class ReplicaCheckConfig:  # replica_check.ReplicaCheck
    dp_replica_check_interval: int | None
    spike_guard: bool  # on: the default interval, a rollback where no majority tells the healthy replica, the cap
    spike_guard_snapshot_interval: int  # the default interval: each snapshot taken right after a check
    spike_guard_max_hardware_faults: int  # a DP rank found differing this many times: the run stops, naming it
    zero_stage: int  # 1 or more: each DP rank holds its own shard of the optimizer state, nothing to compare
    deepspeed: bool  # the same for DeepSpeed's partitions
