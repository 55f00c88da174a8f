"""The stability layer's keys and their checks: the spike guard (lesson 21), the soft skip, telemetry, the skip list
and fault injection. arguments.Config is made of each owner's keys; this file is the stability layer's part.

Each key is declared once, in the section of the part that reads it (a dataclass below, its fields
the keys by their names); StabilityConfig is the sections composed, as arguments.Config composes the
owners. Each callback is handed its section when it is built (sections.section, in
stability.build_callbacks), and the core's keys it needs (clip_grad, seed, save, ...) as arguments,
by name. check() is the one function here that reads the whole config: the checks of keys across
sections and owners; each section's own checks take the section.

The dependency runs from this layer to the core, never back: the checks below use the core's rules
(schedule.parse_iteration_ranges), and stability.precursors is imported inside check() only.
"""

import math
from dataclasses import dataclass

import schedule
from sections import section

# -----------------------------------------------------------------------------
# The keys, each declared once, in the section of the part that reads it; StabilityConfig is their
# composition. A part that needs a key of another section, or of the core (clip_grad, seed, save...),
# gets its value at construction from stability.construction, by name.


@dataclass
class SoftSkipConfig:  # soft_skip.SoftSkip
    # -- stability: the soft skip, telemetry, the skip list, the spike guard (lesson 21), fault injection --
    # loss > this x its trend: gradients x trend/loss before clipping (0: off)
    soft_skip_loss_ratio: float = 0.0


@dataclass
class TelemetryConfig:  # telemetry.Recording
    # -- stability --
    # per-layer grad/param/update norms, activations, logits every N iterations (0: off)
    telemetry_interval: int = 0


@dataclass
class ReplicaCheckConfig:  # replica_check.ReplicaCheck
    # -- stability --
    # checksum the DP replicas' state every N iters (None: guard's)
    dp_replica_check_interval: int | None = None


@dataclass
class SkipListConfig:  # skip_list.SkipList
    # -- stability --
    # a skip list (<save>/skip_documents.jsonl): no sample takes its documents
    skip_documents: str | None = None


@dataclass
class GuardConfig:  # spike_guard.SpikeGuard: what a spike calls for
    # -- stability --
    # skip a spiking step; if it persists roll back and skip data; on a relapse lower the LR
    spike_guard: bool = False
    # spikes (or NaN/inf steps) within spike_guard_rewind iterations before a rollback
    spike_guard_max_skips: int = 3
    # roll back to before (first spike - this) and skip the data from there ...
    spike_guard_rewind: int = 100
    # ... to this many iterations after the last spike (PaLM: 200-500 in all)
    spike_guard_skip_after: int = 200
    # on a relapse (a second rollback), multiply the LR by this from then on
    spike_guard_lr_factor: float = 0.5
    # on a relapse, also reset the optimizer with the lr=0 warm-up (lesson 8)
    spike_guard_reset_optimizer: bool = False
    # more would be needed: save the last good state and exit (code 3)
    spike_guard_max_rollbacks: int = 3
    # iterations skipped by the guard in all, then save and exit (code 3)
    spike_guard_max_skipped_iters: int = 2000
    # transient faults on one DP rank before the run stops, naming it
    spike_guard_max_hardware_faults: int = 3
    # numerical diagnoses in spike_guard_rewind iterations: persistent, stop
    spike_guard_max_numerical: int = 4


@dataclass
class DetectorConfig:  # detector.Detector: what a spike is
    # -- stability --
    # applied steps in the trailing loss / grad-norm statistics (OLMo-core: 128)
    spike_guard_window: int = 128
    # applied steps recorded before it judges (its own warm-up; the LR's need not end)
    spike_guard_min_steps: int = 16
    # a spike: loss or grad norm this many spreads above its trend's prediction ...
    spike_guard_zscore: float = 6.0
    spike_guard_ema_ratio: float = 1.1  # ... and above this multiple of the predicted value
    # ... or the grad norm this multiple (a clean tiny run: lone 12x jumps)
    spike_guard_grad_norm_ratio: float = 100.0
    # ... or the loss this many steps in a row over half that zscore (0: off)
    spike_guard_rise_steps: int = 3
    # ... or far below an unseen batch's loss, measured every N iters (0: off)
    spike_guard_unseen_interval: int = 10
    # the weights' move per update this x its trend, at each snapshot (0: off)
    spike_guard_update_ratio: float = 4.0


@dataclass
class SnapshotConfig:  # snapshots.Snapshots: the states a rollback returns to
    # -- stability --
    # a CPU copy of the run every N iterations to roll back to (0: disk only)
    spike_guard_snapshot_interval: int = 50
    # node-local disk ($SLURM_TMPDIR): snapshots there, not in host memory
    spike_guard_snapshot_dir: str | None = None


@dataclass
class ForensicsConfig:  # guard.Forensics
    # -- stability --
    # fp16/bf16: replay a reproduced spike in fp32 (an fp32 copy of the weights)
    spike_guard_fp32_replay: bool = True


@dataclass
class PrecursorConfig:  # guard.Precursor, spike_guard.precursor_rung
    # -- stability --
    # EXPERIMENTAL early rung (None: off): cut the LR when this passes ...
    spike_guard_precursor: str | None = None
    # ... this threshold (docs/spike_guard.md, section 7)
    spike_guard_precursor_threshold: float | None = None
    # ... by this factor, once per crossing (precursors.PRECURSORS)
    spike_guard_precursor_lr_factor: float = 0.5


@dataclass
class SkipStepConfig:  # remedies.SkipStep
    # -- stability: the field's remedies, baselines for the guard (stability/remedies.py; docs/spike_guard.md) --
    # OLMo-core's SkipStep: skip a step > this many stds above the window (6; 0: off)
    skip_step_sigma: float = 0.0
    # ... the previous steps' losses and grad norms it is judged against (OLMo-core: 128)
    skip_step_window: int = 128


@dataclass
class SpikyLossConfig:  # remedies.SpikyLoss
    # -- stability --
    # Megatron's spiky loss: a loss >= this x the largest seen is re-run (10; 0: off)
    spiky_loss_factor: float = 0.0
    # ... the first steps whose largest loss is the bar (Megatron: 100)
    spiky_loss_samples: int = 100


@dataclass
class ZClipConfig:  # remedies.ZClip
    # -- stability --
    # ZClip: clip a grad norm whose z-score over its EMA is above this (2.5; 0: off)
    zclip_z: float = 0.0
    zclip_alpha: float = 0.97  # ... the EMA's smoothing factor (ZClip: 0.97)
    zclip_warmup: int = 25  # ... grad norms collected before the EMA starts (ZClip: 25)


@dataclass
class RestartConfig:  # remedies.OptRestart, remedies.PalmRestart
    # -- stability --
    # the automated checkpoint restarts (remedies.OptRestart, PalmRestart; 0: off): on a spike,
    opt_restart_lr_factor: float = 0.0  # OPT's: back to the last checkpoint, the LR x this (0.25)
    palm_restart_skip: int = 0  # PaLM's: back palm_restart_back iterations, skip this many (200)
    palm_restart_back: int = 100  # ... to the newest checkpoint this far before the spike (PaLM)
    restart_sigma: float = 6.0  # their spike: the loss this many stds above the window's mean ...
    restart_window: int = 128  # ... of these previous steps (OLMo-core's SkipStep rule: 6, 128)
    restart_max: int = 3  # restarts in a run, then none (spike_guard_max_rollbacks' default)


@dataclass
class FaultsConfig:  # faults.Faults
    # -- stability --
    # fault injection: iterations ("40-45") given random-token batches
    inject_bad_batch_iters: list[str] | None = None
    # fault injection: iteration ranges whose LR is x inject_lr_factor
    inject_lr_iters: list[str] | None = None
    inject_lr_factor: float = 100.0  # the LR multiplier of inject_lr_iters
    # inject_lr_iters on every pass (a resume with a higher LR), not once in time
    inject_lr_persistent: bool = False
    # fault injection: iterations given degenerate batches ...
    inject_degenerate_iters: list[str] | None = None
    # ... one token repeated ("repeat"), an 8-gram ("ngram"), or "minority":
    inject_degenerate_kind: str = "repeat"
    inject_degenerate_fraction: float = 0.25  # ... random tokens in this fraction of the samples
    # fault injection: flip a bit of one gradient element at these iters
    inject_bitflip_iters: list[str] | None = None
    # ... on this rank, after the DP all-reduce (a faulty GPU: silent data corruption)
    inject_bitflip_rank: int = 0
    # ... of a gradient ("grad"), a weight, "exp_avg", "exp_avg_sq" or "master"
    inject_bitflip_target: str = "grad"
    inject_bitflip_bit: int = -1  # ... this bit of the element (-1: the top exponent bit)
    # ... this element of the first matrix (-1: its largest in magnitude)
    inject_bitflip_element: int = -1
    # fault injection: a cancellation only half precision loses
    inject_numerical_iters: list[str] | None = None
    # fault injection: Adam's moments zeroed before this step
    inject_lost_optimizer_state_iter: int | None = None
    # fault injection: a block of repeated documents in corpus order ...
    inject_repeat_iters: list[str] | None = None
    # ... its iterations given again the samples of its first this many iterations
    inject_repeat_period: int = 1
    inject_overflow_iters: list[str] | None = None  # fault injection (fp16): gradients overflow
    # fault injection: sample ranges ("0-7") bad in the corpus ...
    inject_bad_samples: list[str] | None = None
    # ... random tokens, "repeat", "ngram" or "duplicate" ...
    inject_bad_samples_kind: str = "random"
    inject_duplicate_period: int = 8  # ... of the range's first this many samples, in turn
    # fault injection: inject_bitflip_rank's device bad from here on
    inject_bad_device_iter: int | None = None


@dataclass
class StabilityConfig(
    FaultsConfig,
    RestartConfig,
    ZClipConfig,
    SpikyLossConfig,
    SkipStepConfig,
    PrecursorConfig,
    ForensicsConfig,
    SnapshotConfig,
    DetectorConfig,
    GuardConfig,
    SkipListConfig,
    ReplicaCheckConfig,
    TelemetryConfig,
    SoftSkipConfig,
):
    """Every key of the stability layer, flat: the sections above composed (a dataclass's fields
    come base class last first: the soft skip's first, the faults' last). usage.py reads these bases
    for `--help`."""


def need(ok, message):
    if not ok:
        raise ValueError(message)


def check(cfg):
    """Raise ValueError with the fix for stability keys that cannot work. The whole config: the keys
    that work only together, across sections and with the core's (deepspeed, save, fp16), are
    checked here; each section's own checks take the section."""
    check_faults(section(FaultsConfig, cfg), half=cfg.fp16 or cfg.bf16)
    need(
        not cfg.inject_overflow_iters or cfg.fp16,
        "inject_overflow_iters makes fp16's gradients overflow: set fp16 (bf16 and fp32 have "
        "fp32's range)",
    )
    need(
        cfg.dp_replica_check_interval is None or cfg.dp_replica_check_interval >= 0,
        "dp_replica_check_interval must be 0 (off), a number of iterations, or None (with spike_guard: its "
        "spike_guard_snapshot_interval)",
    )
    need(cfg.telemetry_interval >= 0, "telemetry_interval must be >= 0 (0 turns telemetry off)")
    need(
        not (cfg.deepspeed and cfg.telemetry_interval),
        "telemetry_interval needs the gradients before the "
        "update, which DeepSpeed keeps inside its step(); set telemetry_interval=0 or deepspeed=False",
    )
    need(
        not (cfg.deepspeed and cfg.spike_guard),
        "spike_guard judges the loss and grad norm before the update, "
        "which DeepSpeed computes inside its step(); set spike_guard=False or deepspeed=False",
    )
    need(
        not (cfg.deepspeed and cfg.soft_skip_loss_ratio),
        "soft_skip_loss_ratio scales the gradients before the "
        "update, which DeepSpeed keeps inside its step(); set soft_skip_loss_ratio=0 or deepspeed=False",
    )
    check_detector(section(DetectorConfig, cfg))
    check_guard(section(GuardConfig, cfg))
    check_snapshots(section(SnapshotConfig, cfg))
    need(
        not cfg.spike_guard or cfg.spike_guard_snapshot_interval or cfg.save,
        "spike_guard with spike_guard_snapshot_interval=0 rolls back to disk checkpoints: set save and save_interval",
    )
    need(
        cfg.soft_skip_loss_ratio == 0 or cfg.soft_skip_loss_ratio >= 1,
        f"soft_skip_loss_ratio={cfg.soft_skip_loss_ratio} must be 0 (off) or >= 1 (a multiple of the loss's trend)",
    )
    check_precursor(section(PrecursorConfig, cfg), cfg.telemetry_interval)
    remedies = [k for k in ("skip_step_sigma", "spiky_loss_factor", "zclip_z") if getattr(cfg, k)]
    need(
        not (cfg.deepspeed and remedies),
        f"{', '.join(remedies)} judge the loss and grad norm before the update, "
        "which DeepSpeed computes inside its step(); set them to 0 or deepspeed=False",
    )
    check_remedies(
        section(SkipStepConfig, cfg), section(SpikyLossConfig, cfg), section(ZClipConfig, cfg)
    )
    check_restarts(
        section(RestartConfig, cfg), cfg.spike_guard, cfg.deepspeed, cfg.save and cfg.save_interval
    )


def check_detector(detector_cfg):
    d = detector_cfg
    need(
        d.spike_guard_update_ratio == 0 or d.spike_guard_update_ratio > 1,
        "spike_guard_update_ratio must be 0 (off) or above 1: a move per update that many times its trend's",
    )
    need(
        d.spike_guard_unseen_interval >= 0,
        "spike_guard_unseen_interval must be >= 0 (0 turns it off)",
    )
    need(
        d.spike_guard_window >= 2 and 2 <= d.spike_guard_min_steps <= d.spike_guard_window,
        "spike_guard_min_steps must be in [2, spike_guard_window]",
    )
    need(
        d.spike_guard_zscore > 0
        and d.spike_guard_ema_ratio >= 1
        and d.spike_guard_grad_norm_ratio >= 1,
        "spike_guard_zscore must be > 0, spike_guard_ema_ratio and spike_guard_grad_norm_ratio >= 1",
    )
    need(
        d.spike_guard_rise_steps == 0 or 2 <= d.spike_guard_rise_steps <= d.spike_guard_window,
        "spike_guard_rise_steps must be 0 (off) or in [2, spike_guard_window]: one step over half the zscore is a "
        "clean run's noise, and the series keeps spike_guard_window steps",
    )


def check_guard(guard_cfg):
    g = guard_cfg
    need(
        g.spike_guard_max_skips >= 1
        and g.spike_guard_rewind >= 0
        and g.spike_guard_skip_after >= 0,
        "spike_guard_max_skips must be >= 1, spike_guard_rewind and spike_guard_skip_after >= 0",
    )
    need(0 < g.spike_guard_lr_factor <= 1, "spike_guard_lr_factor must be in (0, 1]")
    need(g.spike_guard_max_hardware_faults >= 1, "spike_guard_max_hardware_faults must be >= 1")
    need(
        g.spike_guard_max_numerical >= 1,
        "spike_guard_max_numerical must be >= 1 (the numerical diagnoses before a stop)",
    )


def check_snapshots(snapshot_cfg):
    s = snapshot_cfg
    need(
        s.spike_guard_snapshot_interval >= 0,
        "spike_guard_snapshot_interval must be >= 0 (0: disk checkpoints)",
    )
    need(
        not s.spike_guard_snapshot_dir or s.spike_guard_snapshot_interval,
        "spike_guard_snapshot_dir holds the snapshots of spike_guard_snapshot_interval: set an interval (e.g. 50)",
    )
    if s.spike_guard_snapshot_dir:
        check_directory(s.spike_guard_snapshot_dir, "spike_guard_snapshot_dir")


def check_precursor(precursor_cfg, telemetry_interval):
    p = precursor_cfg
    if p.spike_guard_precursor is not None:
        from stability.precursors import PRECURSORS

        need(
            p.spike_guard_precursor in PRECURSORS,
            f"spike_guard_precursor={p.spike_guard_precursor!r} is not one of {', '.join(PRECURSORS)}",
        )
        need(
            p.spike_guard_precursor_threshold is not None
            and math.isfinite(p.spike_guard_precursor_threshold),
            "spike_guard_precursor needs spike_guard_precursor_threshold (a number: docs/spike_guard.md has the "
            "thresholds measured on the stability lab's clean runs; tools/precursors.py measures yours)",
        )
        need(
            telemetry_interval > 0,
            "spike_guard_precursor reads the telemetry: set telemetry_interval (e.g. 10)",
        )
    need(
        p.spike_guard_precursor is not None or p.spike_guard_precursor_threshold is None,
        "spike_guard_precursor_threshold does nothing without spike_guard_precursor: set "
        "spike_guard_precursor (docs/spike_guard.md, section 7) or leave the threshold out",
    )
    need(
        0 < p.spike_guard_precursor_lr_factor <= 1,
        "spike_guard_precursor_lr_factor must be in (0, 1]",
    )


def check_faults(faults_cfg, half):
    """Fault injection's keys: ranges, targets, bits. half: the run's weights are fp16 or bf16."""
    f = faults_cfg
    for key in (
        "inject_bad_batch_iters",
        "inject_lr_iters",
        "inject_bitflip_iters",
        "inject_numerical_iters",
        "inject_degenerate_iters",
        "inject_repeat_iters",
        "inject_overflow_iters",
    ):
        schedule.parse_iteration_ranges(getattr(f, key), key)
    need(
        f.inject_bitflip_target in ("grad", "weight", "exp_avg", "exp_avg_sq", "master"),
        "inject_bitflip_target must be 'grad', 'weight', or the optimizer's 'exp_avg', "
        "'exp_avg_sq' or 'master'",
    )
    width = bitflip_width(f.inject_bitflip_target, half)
    need(
        -1 <= f.inject_bitflip_bit < width,
        f"inject_bitflip_bit={f.inject_bitflip_bit} is not a bit of the {width}-bit element "
        f"it flips (inject_bitflip_target={f.inject_bitflip_target}): give 0-{width - 1}, "
        "or -1 for the top exponent bit",
    )
    need(
        f.inject_lost_optimizer_state_iter is None or f.inject_lost_optimizer_state_iter >= 1,
        "inject_lost_optimizer_state_iter must be an iteration (>= 1), or None (off)",
    )
    need(
        f.inject_degenerate_kind in ("repeat", "ngram", "minority"),
        f"inject_degenerate_kind={f.inject_degenerate_kind!r} must be 'repeat', 'ngram' or "
        "'minority'",
    )
    need(
        0 < f.inject_degenerate_fraction < 1,
        "inject_degenerate_fraction must be in (0, 1): a minority's share",
    )
    need(
        f.inject_repeat_period >= 1,
        "inject_repeat_period must be >= 1 (the iterations whose samples repeat)",
    )
    sample_ranges(f.inject_bad_samples, "inject_bad_samples")
    need(
        f.inject_bad_samples_kind in SAMPLE_KINDS,
        f"inject_bad_samples_kind={f.inject_bad_samples_kind!r} must be one of "
        f"{', '.join(SAMPLE_KINDS)}",
    )
    need(
        f.inject_duplicate_period >= 1,
        "inject_duplicate_period must be >= 1 (the samples a duplicate block repeats)",
    )
    need(
        f.inject_bad_device_iter is None or f.inject_bad_device_iter >= 1,
        "inject_bad_device_iter must be an iteration (>= 1), or None (off)",
    )


SAMPLE_KINDS = ("random", "repeat", "ngram", "duplicate")  # inject_bad_samples_kind's names


def sample_ranges(ranges, key):
    """["0-7", "96-99"] -> [(0, 7), (96, 99)]: consumed-sample indices (0-based, inclusive: the
    first sample of the run is 0, as loader.sample_indices counts them)."""
    return schedule.parse_iteration_ranges(
        ranges, key, lowest=0, unit="consumed-sample indices, 0-based and inclusive, e.g. 96-103"
    )


def bitflip_width(target, half):
    """The width in bits of the element inject_bitflip_target flips: a weight is in the run's
    precision (fp16, bf16: 16 bits); gradients (accumulated in fp32: precision.grad_dtype), Adam's
    moments and the masters are fp32. half: the run is fp16 or bf16."""
    return 16 if target == "weight" and half else 32


def check_directory(path, key):
    """A directory the run will create (or use) at `path`: refused, naming the key, when it cannot
    be -- the path or its nearest existing parent is not a directory, or that parent is not
    writable -- before any work is done (else a bare errno when the run first writes there)."""
    import os

    path = os.path.abspath(path)
    if os.path.exists(path):
        need(
            os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK),
            f"{key}={path} is "
            + ("not a directory" if not os.path.isdir(path) else "not writable")
            + ": give a directory the run can write (a node-local disk, e.g. $SLURM_TMPDIR)",
        )
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    need(
        os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK),
        f"{key}={path} cannot be created: {parent} is "
        + ("a file, not a directory" if not os.path.isdir(parent) else "not writable")
        + "; give a directory the run can create or write (a node-local disk, e.g. $SLURM_TMPDIR)",
    )


def check_remedies(skip_step_cfg, spiky_loss_cfg, zclip_cfg):
    """The field's remedies (stability/remedies.py): their keys' ranges."""
    s, spiky, z = skip_step_cfg, spiky_loss_cfg, zclip_cfg
    need(
        s.skip_step_sigma >= 0 and s.skip_step_window >= 4,
        "skip_step_sigma must be >= 0 (0: off) and skip_step_window >= 4 (its warm-up is half of it, >= 2 steps)",
    )
    need(
        spiky.spiky_loss_factor == 0 or spiky.spiky_loss_factor > 1,
        f"spiky_loss_factor={spiky.spiky_loss_factor} must be 0 (off) or > 1 (a multiple of the largest loss seen)",
    )
    need(
        spiky.spiky_loss_samples >= 1,
        "spiky_loss_samples must be >= 1 (the steps whose largest loss is the bar)",
    )
    need(
        z.zclip_z >= 0 and 0 < z.zclip_alpha < 1 and z.zclip_warmup >= 2,
        "zclip_z must be >= 0 (0: off), zclip_alpha in (0, 1) and zclip_warmup >= 2 (a variance needs 2 values)",
    )


def check_restarts(restart_cfg, spike_guard, deepspeed, saves):
    """The automated checkpoint restarts (remedies.OptRestart, PalmRestart): ranges, and the disk
    checkpoints they go back to. saves: save and save_interval are set."""
    r = restart_cfg
    need(
        0 <= r.opt_restart_lr_factor < 1,
        f"opt_restart_lr_factor={r.opt_restart_lr_factor} must be 0 (off) or in (0, 1): a "
        "restart at the same LR would replay the spike (OPT's seeds: x0.25)",
    )
    need(
        r.palm_restart_skip >= 0 and r.palm_restart_back >= 0,
        "palm_restart_skip (0: off; PaLM: 200-500) and palm_restart_back (PaLM: ~100) must be >= 0",
    )
    need(
        r.restart_sigma > 0 and r.restart_window >= 4 and r.restart_max >= 1,
        "restart_sigma must be > 0, restart_window >= 4 (its warm-up is half of it) and "
        "restart_max >= 1",
    )
    on = [k for k in ("opt_restart_lr_factor", "palm_restart_skip") if getattr(r, k)]
    if not on:
        return
    need(
        len(on) == 1,
        "opt_restart_lr_factor and palm_restart_skip are two baselines: set one of them to 0",
    )
    need(
        not spike_guard,
        f"{on[0]} is a baseline the spike guard is compared with, and both "
        f"would roll the run back: set spike_guard=False or {on[0]}=0",
    )
    need(
        not deepspeed,
        f"{on[0]} judges the loss before the update, which DeepSpeed "
        "computes inside its step(); set it to 0 or deepspeed=False",
    )
    need(
        saves,
        f"{on[0]} restarts from the run's disk checkpoints: set "
        "save=DIR and save_interval (e.g. 100)",
    )
