"""The stability layer: what the run does about instabilities by itself, as callbacks the loop calls
(training.Callback), one per concern, each with its section of the config beside it (its class's Config) and
its own state in the checkpoint.

    faults.py      Faults: spikes made on purpose (fault injection)
    guard.py       Guard: the spike guard's decisions carried out; Precursor: its early rung; Forensics: a suspect
                   step replayed and tested
    spike_guard.py the guard's decisions (skip, rollback, LR cut, stop) and the run's timeline
    detector.py    is a step a spike: the trend lines and the rules
    diagnosis.py   why it spiked: replay, fp32 replay, weights, counterfactual; the samples behind it named
    telemetry.py   Recording: per-layer probes (norms, activations, attention logits and entropy, log Z)
    soft_skip.py   SoftSkip: a step far above its trend taken with less weight
    remedies.py    SkipStep, SpikyLoss, ZClip: the field's remedies (OLMo-core, Megatron-LM, ZClip), baselines
    snapshots.py   Snapshotting: the copies of the run a rollback returns to, and their cost in host memory
    skip_list.py   SkipList: the documents behind data-driven spikes, which the data then leaves out
    replica_check.py ReplicaCheck: the DP replicas' weights and optimizer state compared by checksum, re-synced
    config.py      StabilityConfig: every part's section composed; the checks of keys that work only together

The dependency runs one way: these files use the core (training, model, parallel, optim, schedule, ...), and no core
module imports them; builders.build_callbacks wires them in when the run asks for any of them. Every run imports
them for their sections (stability.config, with the config); none is built until a switch asks.
"""

from collections import namedtuple
from dataclasses import dataclass, field

from sections import section

# not a key: the guard's entry is built for them too (switched_on())
DECIDED = "a checkpoint's guard decisions"

# The parts every callback shares (Shared), built first when the layer is: the spike guard, made of its detector
# (what a spike is) and its decisions (what one calls for), and the snapshots a rollback returns to. Each has its
# section, as a callback has, and is built with it (construction()).
FRAME = ("detector.Detector", "spike_guard.SpikeGuard", "snapshots.Snapshots")

# The callbacks in the order they act (training.Callbacks calls each event in list order): (the switches that
# build it, "module.Class" in stability/). Adding a check, its key included, is its file and a line here
# (docs/forking.md): its class's Config is its section, which stability.config composes with the others.
REGISTRY = [
    # first: the fault is in the batch, the LR and the weights every callback after it sees (the guard judges
    # it, the forensics replay it); its gradient flip comes before telemetry reads the gradients
    (
        (
            "inject_bad_batch_iters",
            "inject_degenerate_iters",
            "inject_lr_iters",
            "inject_bitflip_iters",
            "inject_numerical_iters",
            "inject_lost_optimizer_state_iter",
            "inject_repeat_iters",
            "inject_overflow_iters",
            "inject_bad_samples",
            "inject_bad_device_iter",
        ),
        "faults.Faults",
    ),
    # before telemetry: the forwards that measure the run's nondeterminism as the guard arms are not probed;
    # before the soft skip: a vetoed update is not scaled too. Also with the faults in time: it keeps the timeline
    (
        (
            "spike_guard",
            "spike_guard_precursor",
            "inject_lr_iters",
            "inject_bitflip_iters",
            "inject_lost_optimizer_state_iter",
            DECIDED,
        ),
        "guard.Guard",
    ),
    # its record finished before the forensics replay the step: the probes see the step, not its replays
    (("telemetry_interval",), "telemetry.Recording"),
    # after telemetry: reads this iteration's record
    (("spike_guard_precursor",), "guard.Precursor"),
    # after telemetry's record and before the guard's decision (after_step), which reads its diagnosis
    (("spike_guard",), "guard.Forensics"),
    # the field's remedies (baselines): after the guard, whose veto ends update_factor before them (a step it
    # vetoes never enters their statistics); each sees the step's own loss and grad norm, whatever the others scale
    (("skip_step_sigma",), "remedies.SkipStep"),
    (("spiky_loss_factor",), "remedies.SpikyLoss"),
    (("zclip_z",), "remedies.ZClip"),
    # the automated checkpoint restarts (baselines, never with the guard: config.check_restarts):
    # after the faults' after_step; a restart ends the iteration for the callbacks below
    (("opt_restart_lr_factor",), "remedies.OptRestart"),
    (("palm_restart_skip",), "remedies.PalmRestart"),
    # after the guard's decision and the faults' flips, before the snapshot: a snapshot holds replicas found equal
    (("dp_replica_check_interval", "spike_guard"), "replica_check.ReplicaCheck"),
    # after the guard's veto: scales only an update that is applied
    (("soft_skip_loss_ratio",), "soft_skip.SoftSkip"),
    # last: a snapshot holds the iteration as every other callback left it
    (("spike_guard",), "snapshots.Snapshotting"),
    # anywhere: it acts when the data is built, before the loop
    (("skip_documents",), "skip_list.SkipList"),
]

# The keys that ask for the layer: with none set (and no decision of it in the checkpoint), it is not built.
SWITCHES = tuple(dict.fromkeys(key for keys, _ in REGISTRY for key in keys if key != DECIDED))


@dataclass
class Shared:
    """What the callbacks share, handed to each at construction: the checkpoint writer (a rollback waits for it,
    a stop saves through it); the spike guard (spike_guard.SpikeGuard: the detector's statistics, the decisions,
    the run's timeline, the diagnosis of the current step); the snapshots a rollback returns to; the callbacks
    built before this one, by name."""

    writer: object
    guard: object
    snapshots: object
    built: dict = field(default_factory=dict)


def switched_on(cfg, saved_state=None):
    """The switches set, and DECIDED for a checkpoint whose guard decided something that holds (skip ranges, an
    LR factor: a resumed run honours them with the guard off too)."""
    import run_state

    on = {key for key in SWITCHES if getattr(cfg, key)}
    guard = run_state.callback_states(saved_state or {}).get("spike_guard") or {}
    return on | ({DECIDED} if guard.get("decisions") or guard.get("skip_ranges") else set())


def part(where):
    """The class of a part of the layer, by its "module.Class" in stability/ (REGISTRY's, FRAME's)."""
    import importlib

    module, name = where.rsplit(".", 1)
    return getattr(importlib.import_module(f"stability.{module}"), name)


def build_callbacks(cfg, writer=None, saved_state=None):
    """The run's callbacks (a training.Callbacks) in REGISTRY's order, each built when one of its
    switches is on; None when the run needs none."""
    on = switched_on(cfg, saved_state)
    if not on:
        return None
    from report import print0
    from stability.snapshots import Snapshots
    from stability.spike_guard import SpikeGuard
    from training import Callbacks

    made = construction(cfg)
    shared = Shared(
        writer,
        SpikeGuard(*made["spike_guard.SpikeGuard"]),
        Snapshots(*made["snapshots.Snapshots"], saver=writer),
    )
    for switches, where in REGISTRY:
        if on & set(switches):
            kind = part(where)
            section_cfg, *more = made.get(where) or (section(kind.Config, cfg),)
            callback = kind(section_cfg, shared, *more)
            shared.built[callback.name] = callback
    # two remedies on one step act in this order (a veto ends the update for those after it): said, not implied
    print0(f"stability layer, in the order each step meets it: {', '.join(shared.built)}")
    return Callbacks(shared.built.values())


# What the core's functions read when the layer hands them a step to replay, a forward, a batch to
# draw or the samples to name (training.train_step and forward_backward, loader.micro_batches,
# diagnosis.name_samples): the core's keys, handed by name to the callbacks that replay, not
# declared again.
CORE_KEYS = (
    "micro_batch_size",
    "global_batch_size",
    "clip_grad",
    "skip_grad_norm_above",
    "z_loss",
    "fp16",
    "bf16",
    "deepspeed",
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "tokenizer_file",
    "vocab_size",
    "save",
)
CoreKeys = namedtuple("CoreKeys", CORE_KEYS)


def construction(cfg):
    """What each part of the layer is built with, by its "module.Class": its section of the config
    first, then (after `shared`, for a callback) the values it needs of other sections and of the
    core, by name. A callback not named here is built with its section alone: its class's Config.
    With switched_on, snapshot_plan and config.check, the layer's boundary with the whole config.
    What the layer knows of the optimizer's update comes from here, its entry's numbers
    (optim.OPTIMIZERS): the most one step moves a weight, the lr=0 iterations of a reset."""
    import optim
    from model import GPTConfig

    def own(where):  # a part's section
        return section(part(where).Config, cfg)

    guard_cfg, detector_cfg = own("spike_guard.SpikeGuard"), own("detector.Detector")
    optim_cfg = section(optim.OptimizerConfig, cfg)
    core = CoreKeys(*(getattr(cfg, key) for key in CORE_KEYS))
    interval = cfg.spike_guard_snapshot_interval
    sharded = cfg.deepspeed or cfg.zero_stage >= 1  # each DP rank holds its own optimizer shard
    bound = optim.step_bound(optim_cfg)
    return {
        "spike_guard.SpikeGuard": (detector_cfg, guard_cfg, cfg.clip_grad, interval, bound),
        "snapshots.Snapshots": (snapshot_plan(cfg), (cfg.save, cfg.load), reset_iters(cfg)),
        "faults.Faults": (own("faults.Faults"), cfg.seed, cfg.vocab_size, core),
        "guard.Guard": (guard_cfg, core, cfg.save_interval),
        "telemetry.Recording": (own("telemetry.Recording"), section(GPTConfig, cfg)),
        "guard.Precursor": (own("guard.Precursor"), cfg.adam_eps),
        "guard.Forensics": (own("guard.Forensics"), core),
        "replica_check.ReplicaCheck": (
            own("replica_check.ReplicaCheck"),
            guard_cfg.spike_guard,
            interval,
            guard_cfg.spike_guard_max_hardware_faults,
            sharded,
        ),
        "soft_skip.SoftSkip": (
            own("soft_skip.SoftSkip"),
            detector_cfg.spike_guard_min_steps,
            detector_cfg.spike_guard_window,
        ),
    }


def reset_iters(cfg):
    """The lr=0 iterations of the guard's optimizer reset on a relapse (optim.reset_warmup_iters):
    reset_optimizer_warmup_iters, or "auto" when it is unset and spike_guard_reset_optimizer asks
    for the reset; 0 when neither (the count is then never read). config.check asks it too, so an
    optimizer that cannot answer "auto" is refused before any work."""
    import optim

    relapse = "auto" if cfg.spike_guard_reset_optimizer else None
    optim_cfg = section(optim.OptimizerConfig, cfg)
    return optim.reset_warmup_iters(optim_cfg, cfg.reset_optimizer_warmup_iters, relapse)


def snapshot_plan(cfg):
    """The snapshots' number, place and size (snapshots.Plan) of a run's config; estimate.py's dry
    run asks too."""
    from stability.snapshots import Plan

    return Plan(
        interval=cfg.spike_guard_snapshot_interval if cfg.spike_guard else 0,
        rewind=cfg.spike_guard_rewind,
        directory=cfg.spike_guard_snapshot_dir,
        half=cfg.fp16 or cfg.bf16,
        zero1=cfg.zero_stage >= 1,
        engine=cfg.deepspeed,
        async_copy=cfg.async_save,
    )
