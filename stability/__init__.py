"""The stability layer: what the run does about instabilities by itself, as callbacks the loop calls
(training.Callback).

    hooks.py        StabilityHooks: what the loop's named points do, and in which order
    spike_guard.py  the spike guard: detection, diagnosis (forensics), decisions, the precursor rung
    snapshots.py    the copies of the run a rollback returns to, and their cost in host memory
    skip_list.py    the documents behind data-driven spikes, which the data then leaves out
    faults.py       fault injection: spikes made on purpose
    telemetry.py    per-layer probes: norms, activations, attention logits and entropy, log Z
    config.py       the layer's keys and their checks

The dependency runs one way: these files use the core (step, model, parallel, optim, schedule, ...), and no
core module imports them; builders.build_callbacks wires them in when the run asks for any of them.
"""

# The keys that ask for the layer: with none set (and no decision of it in the checkpoint), it is not built.
SWITCHES = ("spike_guard", "soft_skip_loss_ratio", "telemetry_interval", "skip_documents", "spike_guard_precursor",
            "inject_bad_batch_iters", "inject_lr_iters", "inject_bitflip_iters", "inject_numerical_iters",
            "inject_degenerate_iters")


def wanted(cfg, saved_state=None):
    """Does this run need the layer: a switch set, or a checkpoint whose guard decided something that holds (skip
    ranges, an LR factor, its counters: a resumed run honours them with the guard off too)?"""
    import run_state
    guard = run_state.callback_states(saved_state or {}).get("spike_guard") or {}
    return any(getattr(cfg, key) for key in SWITCHES) or bool(guard.get("decisions") or guard.get("skip_ranges"))


def build_callbacks(cfg, writer=None, saved_state=None):
    """The run's callbacks (a training.Callbacks), or None when it needs none."""
    if not wanted(cfg, saved_state):
        return None
    from training import Callbacks
    from stability.hooks import StabilityHooks
    return Callbacks([StabilityHooks(cfg, writer)])
