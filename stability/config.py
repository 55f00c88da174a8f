"""The stability layer's keys: StabilityConfig, every part's section composed, and the checks of
the keys that work only together.

Each key is declared once, in the section of the part that reads it: a dataclass beside the part,
in its own file (faults.FaultsConfig beside faults.Faults), named as the part's `Config`, as the
core's owners keep theirs (checkpoint.CheckpointConfig). StabilityConfig composes the sections of
the parts stability.REGISTRY and stability.FRAME name, so a check with a key of its own is its
file and its registry line (docs/forking.md); arguments.Config composes StabilityConfig with the
core's sections, and usage.py reads the same composition from the source for `--help`.

Each part is handed its section when it is built (sections.section, in stability.build_callbacks),
and the core's keys it needs (clip_grad, seed, save, ...) as arguments, by name. check() is the
one function here that reads the whole config: the checks of keys across sections and owners; each
section's own checks take the section. Every run imports the layer's modules for their sections;
a run builds its parts only when a switch asks (stability.build_callbacks).
"""

import math
import os
from dataclasses import dataclass

import files
import optim
import schedule
from sections import section
from stability import FRAME, REGISTRY, part, reset_iters, skip_list
from stability.detector import DetectorConfig
from stability.faults import SAMPLE_KINDS, FaultsConfig, bitflip_width, sample_ranges
from stability.guard import PrecursorConfig
from stability.remedies import RestartConfig, SkipStepConfig, SpikyLossConfig, ZClipConfig
from stability.snapshots import SnapshotConfig
from stability.spike_guard import GuardConfig


def sections():
    """Each part's section (its class's Config), once, in the order the parts act: the frame's, then
    REGISTRY's; the order of the keys in StabilityConfig and in `--help`."""
    wheres = (*FRAME, *(where for _, where in REGISTRY))
    return list(dict.fromkeys(part(where).Config for where in wheres))


# a dataclass's fields come base class last first: the bases reversed, the keys in sections()'s order
@dataclass
class StabilityConfig(*reversed(sections())):
    """Every key of the stability layer, flat: the parts' sections composed."""


def need(ok, message):
    if not ok:
        raise ValueError(message)


def check(cfg, world_size=1):
    """Raise ValueError with the fix for stability keys that cannot work. The whole config: the keys
    that work only together, across sections and with the core's (deepspeed, save, fp16, optimizer, the
    number of processes), are checked here; each section's own checks take the section."""
    check_faults(section(FaultsConfig, cfg), half=cfg.fp16 or cfg.bf16)
    # else refused by the data's build, after the model's
    need(
        not cfg.skip_documents or os.path.isfile(cfg.skip_documents),
        skip_list.missing(cfg.skip_documents),
    )
    check_faults_with_the_core(cfg, world_size)
    need(
        cfg.dp_replica_check_interval is None or cfg.dp_replica_check_interval >= 0,
        "dp_replica_check_interval must be 0 (off), a number of iterations, or None (with spike_guard: its "
        "spike_guard_snapshot_interval)",
    )
    need(cfg.telemetry_interval >= 0, "telemetry_interval must be >= 0 (0 turns telemetry off)")
    check_beside_deepspeed(cfg)
    check_detector(section(DetectorConfig, cfg))
    if cfg.spike_guard:  # its relapse's reset count: the optimizer must be able to say it
        reset_iters(cfg)
    check_guard(section(GuardConfig, cfg))
    check_snapshots(section(SnapshotConfig, cfg))
    need(  # and reads the weights' move at each of them (Guard.update_size)
        not cfg.spike_guard
        or cfg.spike_guard_snapshot_interval
        or (cfg.save and cfg.save_interval),
        "spike_guard with spike_guard_snapshot_interval=0 rolls back to disk checkpoints: set save and save_interval",
    )
    need(
        cfg.soft_skip_loss_ratio == 0 or cfg.soft_skip_loss_ratio >= 1,
        f"soft_skip_loss_ratio={cfg.soft_skip_loss_ratio} must be 0 (off) or >= 1 (a multiple of the loss's trend)",
    )
    check_precursor(section(PrecursorConfig, cfg), cfg.telemetry_interval)
    check_remedies(
        section(SkipStepConfig, cfg), section(SpikyLossConfig, cfg), section(ZClipConfig, cfg)
    )
    check_restarts(
        section(RestartConfig, cfg),
        cfg.spike_guard,
        cfg.deepspeed,
        cfg.save and cfg.save_interval,
        skip_step=bool(cfg.skip_step_sigma),
    )


def check_beside_deepspeed(cfg):
    """What reads the gradients, the loss or the grad norm before the update: DeepSpeed keeps them inside its
    step()."""
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
    remedies = [k for k in ("skip_step_sigma", "spiky_loss_factor", "zclip_z") if getattr(cfg, k)]
    need(
        not (cfg.deepspeed and remedies),
        f"{', '.join(remedies)} judge the loss and grad norm before the update, "
        "which DeepSpeed computes inside its step(); set them to 0 or deepspeed=False",
    )


def check_faults_with_the_core(cfg, world_size):
    """Faults that would not happen, in silence, or fail mid-run: an overflow without fp16, on a rank the run does
    not have, inside a DeepSpeed step, or on moments the optimizer does not keep."""
    need(
        not cfg.inject_overflow_iters or cfg.fp16,
        "inject_overflow_iters makes fp16's gradients overflow: set fp16 (bf16 and fp32 have "
        "fp32's range)",
    )
    on_a_rank = [k for k in ("inject_bitflip_iters", "inject_bad_device_iter") if getattr(cfg, k)]
    need(
        not on_a_rank or 0 <= cfg.inject_bitflip_rank < world_size,
        f"{', '.join(on_a_rank)} strike rank inject_bitflip_rank={cfg.inject_bitflip_rank}, and the run has "
        f"{world_size} process(es): give a rank below {world_size}",
    )
    # DeepSpeed keeps the gradients and the optimizer's state inside its step(), and its masters overwrite a weight
    inside = on_a_rank + (
        ["inject_lost_optimizer_state_iter"] if cfg.inject_lost_optimizer_state_iter else []
    )
    need(
        not (cfg.deepspeed and inside),
        f"{', '.join(inside)} act on the gradients, the weights or the optimizer's state, which DeepSpeed keeps "
        "inside its step(): unset them or set deepspeed=False",
    )
    moments = (
        ["inject_lost_optimizer_state_iter"] if cfg.inject_lost_optimizer_state_iter else []
    ) + (
        [f"inject_bitflip_target={cfg.inject_bitflip_target}"]
        if cfg.inject_bitflip_iters and cfg.inject_bitflip_target in ("exp_avg", "exp_avg_sq")
        else []
    )
    name = optim.optimizer_name(cfg.optimizer, cfg.use_bnb_optimizer)
    need(
        not moments or name == "adamw",
        f"{', '.join(moments)} act on AdamW's exp_avg and exp_avg_sq, which optimizer={name} does not keep "
        "under those names: use optimizer=adamw",
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
        g.spike_guard_max_skips >= 1 and g.spike_guard_rewind >= 0,
        "spike_guard_max_skips must be >= 1, spike_guard_rewind >= 0",
    )
    need(0 < g.spike_guard_lr_factor <= 1, "spike_guard_lr_factor must be in (0, 1]")
    need(g.spike_guard_max_hardware_faults >= 1, "spike_guard_max_hardware_faults must be >= 1")
    need(
        g.spike_guard_max_rollbacks >= 0 and g.spike_guard_max_skipped_iters >= 0,
        "spike_guard_max_rollbacks and spike_guard_max_skipped_iters must be >= 0 (0: none, the run stops instead)",
    )
    need(
        g.spike_guard_max_numerical >= 1,
        "spike_guard_max_numerical must be >= 1 (the numerical diagnoses that make a fault persistent)",
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
        files.check_output_dir(
            s.spike_guard_snapshot_dir,
            "spike_guard_snapshot_dir",
            "a directory the run can write (a node-local disk, e.g. $SLURM_TMPDIR)",
        )


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
    check_fault_values(f)
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


def check_fault_values(f):
    """The values a fault multiplies or indexes by. f: a FaultsConfig."""
    # a factor of 1 injects nothing; one of 0 or below stops or reverses the updates
    need(
        f.inject_lr_factor > 0 and f.inject_lr_factor != 1,
        f"inject_lr_factor={f.inject_lr_factor} must be positive and not 1 (the LR's multiplier in inject_lr_iters)",
    )
    need(
        f.inject_bitflip_element >= -1,
        f"inject_bitflip_element={f.inject_bitflip_element} must be an element's index, or -1 for the largest",
    )


def check_remedies(skip_step_cfg, spiky_loss_cfg, zclip_cfg):
    """The field's remedies (stability/remedies.py): their keys' ranges."""
    s, spiky, z = skip_step_cfg, spiky_loss_cfg, zclip_cfg
    need(
        s.skip_step_sigma >= 0 and s.skip_step_window >= 6,
        "skip_step_sigma must be >= 0 (0: off) and skip_step_window >= 6 (its warm-up is half of it: a standard "
        "deviation of the 2 or more values before the step)",
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


def check_restarts(restart_cfg, spike_guard, deepspeed, saves, skip_step=False):
    """The automated checkpoint restarts (remedies.OptRestart, PalmRestart): ranges, and the disk
    checkpoints they go back to. saves: save and save_interval are set; skip_step: SkipStep is on."""
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
        r.restart_sigma > 0 and r.restart_window >= 6 and r.restart_max >= 1,
        "restart_sigma must be > 0, restart_window >= 6 (its warm-up is half of it: a standard deviation of the 2 "
        "or more losses before the step) and "
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
    need(  # a veto ends update_factor before the callbacks below it (stability.REGISTRY)
        not skip_step,
        f"{on[0]} restarts on a loss spike, and skip_step_sigma vetoes that step before the restart's rule sees "
        f"it (no restart would come): set skip_step_sigma=0 or {on[0]}=0",
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
