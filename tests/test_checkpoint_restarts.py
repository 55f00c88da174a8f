"""The automated checkpoint restarts (stability/remedies.py: OptRestart, PalmRestart), baselines
for the guard. In short train.py runs of the tests' 2x64 model with disk checkpoints every 10
iterations and a 20-step window, each on an injected spike: it goes back to the right checkpoint
(its first loss after the restart is the clean run's at that iteration); it does what its recipe
does from there (OPT: the LR x0.25 at every later iteration; PaLM: its window skipped, the run
after it bit for bit a run with skip_train_iteration_range of the same iterations); it keeps its
decisions across a resume (a run stopped after the restart and resumed ends as the one that was
not); and it does nothing on a clean run."""

import re

import pytest

import arguments
from helpers import (  # noqa: F401 (fixtures)
    corpus,
    corpus512,
    guard_model_args,
    log_fields,
    losses,
    run_main,
)
from stability import Shared, remedies
from stability import config as stability_config

WINDOW = ["--restart_window=20"]  # judged from 10 steps: the tests' runs are 50 iterations
OPT = ["--opt_restart_lr_factor=0.25", *WINDOW]
PALM = ["--palm_restart_skip=20", "--palm_restart_back=10", *WINDOW]
LR_FAULT = ["--inject_lr_iters=25-26", "--inject_lr_factor=3000"]  # the loss ~3,000 at 26
BAD_BATCH = ["--inject_bad_batch_iters=35-35"]  # random tokens: the loss ~6.7 against ~5.4 at 35


def cfg_with(**keys):
    cfg = arguments.Config()
    for key, value in keys.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def run(corpus512, tmp_path_factory):  # noqa: F811 (the fixture)
    base = [*guard_model_args(corpus512, iters=50), "--save_interval=10"]  # --save: go()

    def go(*extra, save=None):
        save = save or tmp_path_factory.mktemp("run")
        return run_main(*base, f"--save={save}", *extra)

    return go


@pytest.fixture(scope="module")
def clean(run):
    return run()


def actions(out, name):
    return [line for line in out.splitlines() if line.startswith(f"remedy {name}:")]


def lrs(out):
    return {
        i: float(f["learning rate"]) for i, f in log_fields(out).items() if "learning rate" in f
    }


def after(out, iteration, *keys):
    return {
        i: tuple(f[k] for k in keys)
        for i, f in log_fields(out).items()
        if i > iteration and "lm loss" in f
    }


def test_a_restart_keeps_its_decisions_through_a_rollback_and_its_losses_go_with_the_weights():
    restart = remedies.OptRestart(cfg_with(opt_restart_lr_factor=0.25), Shared(None, None, None))
    restart.losses, restart.lr_scale, restart.skip_ranges = [5.0, 4.9], 0.25, [(21, 40)]
    restart.decisions = [{"action": "restart"}]
    older = {"losses": [6.0], "lr_scale": 1.0, "skip_ranges": [], "decisions": []}
    restart.load_state_dict(older, None, resume=False)  # the checkpoint restarted from
    assert restart.losses == [6.0] and restart.lr_scale == 0.25
    assert restart.skip_ranges == [(21, 40)] and restart.decisions == [{"action": "restart"}]
    restart.load_state_dict(restart.state_dict() | {"lr_scale": 0.0625}, None, resume=True)
    assert restart.lr_scale == 0.0625 and restart.decisions == [{"action": "restart"}]
    assert remedies.loss_spike([5.0, 5.1, 4.9, 5.0, 9.0], 6.0).startswith("loss 9 > mean 5")
    assert remedies.loss_spike([5.0, 5.1, 4.9, 5.0, 5.2], 6.0) is None


def test_bad_restart_keys_name_the_fix():
    on = {"save": "x", "save_interval": 1}
    for keys, words in (
        ({"opt_restart_lr_factor": 1.0}, "opt_restart_lr_factor=1.0 must be 0 (off) or in (0, 1)"),
        (
            {"palm_restart_skip": 200},
            "palm_restart_skip restarts from the run's disk checkpoints: set save=DIR and",
        ),
        (
            {"palm_restart_skip": 200, "opt_restart_lr_factor": 0.25, **on},
            "two baselines: set one of them to 0",
        ),
        (
            {"opt_restart_lr_factor": 0.5, "spike_guard": True, **on},
            "set spike_guard=False or opt_restart_lr_factor=0",
        ),
        ({"restart_window": 5}, "restart_window >= 6"),
        # SkipStep's veto ends update_factor before the restart's rule: the spike it looks for never reached it
        (
            {"opt_restart_lr_factor": 0.25, "skip_step_sigma": 6.0, **on},
            "skip_step_sigma vetoes that step before the restart's rule sees it",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            stability_config.check(cfg_with(**keys))


def test_opt_restart_goes_back_to_the_last_checkpoint_and_cuts_the_lr_from_there(
    run, clean, tmp_path
):
    quiet = run(*OPT)
    assert not actions(quiet, "opt_restart") and losses(quiet) == losses(clean)
    out = run(*OPT, *LR_FAULT)
    [line] = actions(out, "opt_restart")
    assert line.startswith("remedy opt_restart: iteration 26: loss ")
    assert "restarted from the checkpoint of iteration 20; LR x0.25 from iteration 21 on" in line
    assert losses(out)[21] == losses(clean)[21]  # the weights of the checkpoint of iteration 20
    # saved again at once: a run killed now resumes from the restart, not from the timeline it left
    assert "saved checkpoint at iteration       20" in out.split(line)[1].split("\n iteration")[0]
    cut, lr = lrs(out), lrs(clean)
    assert all(cut[i] == pytest.approx(0.25 * lr[i], rel=2e-3) for i in range(21, 51))
    # stopped after the restart (its last checkpoint at 33) and resumed: the cut holds
    run(*OPT, *LR_FAULT, "--train_iters=33", save=tmp_path)
    resumed = run(*OPT, *LR_FAULT, save=tmp_path)
    assert after(resumed, 33, "lm loss") == after(out, 33, "lm loss")
    assert not actions(resumed, "opt_restart")


def test_palm_restart_goes_back_and_skips_the_batches_as_skip_train_iteration_range(
    run, clean, tmp_path
):
    quiet = run(*PALM)
    assert not actions(quiet, "palm_restart") and losses(quiet) == losses(clean)
    out = run(*PALM, *BAD_BATCH)
    [line] = actions(out, "palm_restart")
    # 10 or more before the spike at 35: the checkpoint of 20; 20 batches from there, through 35
    assert line.startswith("remedy palm_restart: iteration 35: loss ") and line.endswith(
        "restarted from the checkpoint of iteration 20; iterations 21-40 skipped (20 batches); "
        "LR unchanged"
    )
    skipped = [i for i in range(1, 51) if f"{i:8d}/      50 | skipped (palm_restart)" in out]
    assert skipped == list(range(21, 41))
    reference = run(*BAD_BATCH, "--skip_train_iteration_range=21-40")
    assert (
        after(out, 40, "lm loss", "consumed samples")
        == after(reference, 40, "lm loss", "consumed samples")
        != {}
    )
    # stopped inside its skipped window (at 38) and resumed: 39 and 40 still skipped
    run(*PALM, *BAD_BATCH, "--train_iters=38", save=tmp_path)
    resumed = run(*PALM, *BAD_BATCH, save=tmp_path)
    assert "      39/      50 | skipped (palm_restart)" in resumed
    assert after(resumed, 38, "lm loss") == after(out, 38, "lm loss") != {}


def test_a_loss_that_is_not_finite_restarts_and_the_cap_ends_the_restarts(run):
    # the LR x1e9 on every pass through 25-26: the loss NaN at 26 each time, however far it is cut;
    # the default window (128) never judges in 50 iterations, so the divergence rule alone acts
    out = run(
        "--opt_restart_lr_factor=0.25",
        "--restart_max=2",
        "--inject_lr_iters=25-26",
        "--inject_lr_factor=1e9",
        "--inject_lr_persistent",
    )
    lines = actions(out, "opt_restart")
    assert [line.split(": ", 2)[1] for line in lines] == ["iteration 26"] * 2 + ["iteration 27"]
    assert all("loss nan (a divergence)" in line for line in lines)
    assert "LR x0.25 from iteration 21" in lines[0] and "LR x0.0625 from iteration 21" in lines[1]
    assert lines[2].endswith("no restart: restart_max=2 reached; the run goes on without restarts")
    assert 50 in log_fields(out)  # it went on
