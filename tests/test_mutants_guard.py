"""The stability layer's survivors of issue #51's mutation audit, each held by the decision it
would change:

- a regime change forgets the strikes before it: a strike before it and one after it skip, not
  roll back;
- the counterfactual is drawn when the next batch is the data's last one (and not past the end);
- no callback's after_step runs once one has rolled the run back; no callback's update_factor is
  asked about a step another has vetoed (a remedy's statistics never see it);
- telemetry's record of an iteration is finished before the forensics replay its step.

Written against what the layer decides and calls (SpikeGuard.update's decisions, training.Callbacks,
the order of build_callbacks' list), not its private state: the layer is being reworked.
"""

import types

import pytest
import torch

import arguments
import training
from helpers import warm_guard
from stability.detector import LEARNT


def spike(guard, iteration, loss, rebase=None):
    """A data spike of text learnt by heart (the one that rolls back) at iteration, its update vetoed: the guard's
    decision."""
    guard.pending = f"loss {loss} is far below an unseen batch's: {LEARNT}"
    diagnosis = {"cause": "data", "evidence": "e", **({"rebase": rebase} if rebase else {})}
    return guard.update(iteration, "vetoed", loss, 1.0, None, diagnosis)


def test_a_regime_change_forgets_the_strikes_before_it():
    """Two strikes of one episode roll back (spike_guard_max_skips=2); a re-base between them starts
    a new episode, so the one after it is the first of its own and is skipped."""
    flags = [
        "--spike_guard_window=16",
        "--spike_guard_min_steps=8",
        "--spike_guard_rewind=10",
        "--spike_guard_max_skips=2",
    ]
    plain = warm_guard(flags, 3.0, 1.0)
    assert (
        spike(plain, 28, 9.0)["action"] == "skip" and spike(plain, 32, 9.0)["action"] == "rollback"
    )
    guard = warm_guard(flags, 3.0, 1.0)
    assert spike(guard, 28, 9.0)["action"] == "skip"
    rebased = spike(guard, 30, 6.0, rebase=(6.1, 1.0))
    assert rebased["action"] == "skip" and "re-based" in rebased["line"]
    after = spike(guard, 32, 18.0)
    assert after["action"] == "skip" and "spike 1 of 2" in after["line"], after["line"]


class Data:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


@pytest.mark.parametrize("number, drawn", [(2, 16), (3, None)])
def test_the_counterfactual_is_drawn_when_the_next_batch_is_the_datas_last(
    monkeypatch, number, drawn
):
    """24 samples, batches of 8, fewer than the held-out batches (guard.HELD_OUT), so the comparison
    batch is the next one: iteration 2's is samples 16-23, the last the data holds -- drawn and
    computed; iteration 3's would start past the end: none."""
    import loader
    from stability import guard

    firsts = []
    monkeypatch.setattr(
        loader, "micro_batches", lambda data, first, *args: firsts.append(first) or ["batch"]
    )
    monkeypatch.setattr(
        training, "whole_step", lambda *args, **kwargs: training.Step(3.0, 1.0, 0, "vetoed")
    )
    scaler = types.SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda state: None)
    cfg = arguments.load_config(["--spike_guard"])
    forensics = guard.Forensics(
        cfg, types.SimpleNamespace(guard=None, snapshots=None, built={}), cfg
    )
    forensics.start(
        types.SimpleNamespace(
            model=torch.nn.Linear(1, 1), optimizer=None, scaler=scaler, rules=None
        ),
        None,
        Data(24),
    )
    it = training.Iteration(number, (number - 1) * 8, 8, 16, batches=["b"], lr=1e-3)
    found = forensics.counterfactual(it)
    assert (found is None) == (drawn is None) and firsts == ([drawn] if drawn is not None else [])
    if found is not None:
        assert found[0].loss == 3.0 and f"iteration {number + 1}'s batch (unseen)" in found[1]


class Spy(training.Callback):
    def __init__(self, log, name, rolls_back=False, factor=1.0):
        self.log, self.label, self.rolls_back, self.factor = log, name, rolls_back, factor

    def after_step(self, it, step):
        self.log.append(("after_step", self.label))
        return self.rolls_back

    def update_factor(self, loss, grad_norm):
        self.log.append(("update_factor", self.label))
        return self.factor


def test_no_callback_acts_on_an_iteration_after_one_rolled_it_back():
    log = []
    callbacks = training.Callbacks(
        [Spy(log, "a"), Spy(log, "guard", rolls_back=True), Spy(log, "snapshot")]
    )
    assert callbacks.after_step(None, None) is True
    assert log == [("after_step", "a"), ("after_step", "guard")]


def test_no_callback_is_asked_about_a_step_another_vetoed():
    """A remedy's update_factor keeps statistics of the steps it is asked about: a vetoed one is not
    applied and must not enter them (the guard's veto comes first in the registry for that
    reason)."""
    log = []
    callbacks = training.Callbacks([Spy(log, "guard", factor=0.0), Spy(log, "remedy", factor=0.5)])
    assert callbacks.update_factor(9.0, 1.0) == 0.0 and log == [("update_factor", "guard")]
    log.clear()
    callbacks = training.Callbacks([Spy(log, "guard", factor=0.5), Spy(log, "remedy", factor=0.5)])
    assert callbacks.update_factor(9.0, 1.0) == 0.25 and len(log) == 2


def test_telemetry_finishes_its_record_before_the_forensics_replay_the_step():
    """The forensics replay a suspect step through train_step, whose callbacks probe the gradients:
    telemetry must have closed the iteration's record before then, or a replay is recorded as the
    step."""
    import stability

    cfg = arguments.prepare(
        arguments.load_config(
            ["--spike_guard", "--telemetry_interval=1", "--save=none", "--save_interval=none"]
        )
    )
    names = [type(c).__name__ for c in stability.build_callbacks(cfg).callbacks]
    assert "Recording" in names and "Forensics" in names, names
    assert names.index("Recording") < names.index("Forensics") < names.index("Snapshotting"), names


def test_a_run_prints_the_order_its_callbacks_act_in(capsys):
    """Two remedies on one step act in the registry's order (a veto ends the update for those after
    it): the run says which order it built, the list's own, not the keys' order on the command line."""
    import stability

    cfg = arguments.prepare(
        arguments.load_config(
            ["--zclip_z=2.5", "--skip_step_sigma=6", "--save=none", "--save_interval=none"]
        )
    )
    built = [c.name for c in stability.build_callbacks(cfg).callbacks]
    assert built == ["skip_step", "zclip"]
    said = [line for line in capsys.readouterr().out.splitlines() if "stability layer" in line]
    assert said == [f"stability layer, in the order each step meets it: {', '.join(built)}"], said
