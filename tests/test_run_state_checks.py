"""A checkpoint's run state is checked when a run resumes it (checkpoint.checked_run_state): a
damaged key is refused by name before anything is built, a key an older version did not write is
filled by its named migration, and the log says so -- never a default in silence. And
reset_optimizer_warmup_iters counts iterations."""

import dataclasses
import os
import re

import pytest
import torch

import checkpoint
import parallel
import run_state
from helpers import SMALL, corpus, log_fields, run_cli, run_main  # noqa: F401 (a fixture)

# as the SMALL model's checkpoint at iteration 2 holds it (global_batch_size 8, seq_length 64)
STATE = {
    "iteration": 2,
    "consumed_samples": 16,
    "consumed_tokens": 1024,
    "scheduler_samples": 16,
    "scheduler_tokens": 1024,
    "optimizer_reset": None,
    "callbacks": {},
    "history": {"loss": [10.9, 10.8], "grad norm": [1.5, 1.4]},
    "hf_origin": None,
}
CONFIG = {
    "seq_length": 64,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "rampup_batch_size": None,
}


@pytest.fixture(scope="module")
def ckpt(corpus, tmp_path_factory):  # noqa: F811
    """global_step2 of the SMALL model; tests copy it before changing it."""
    directory = tmp_path_factory.mktemp("ckpt")
    run_main(*SMALL, "--train_iters=2", "--eval_iters=0", f"--save={directory}")
    return directory


def rewrite_state(directory, change):
    """Apply change(run state dict) to the checkpoint `latest` names, its manifest rewritten to
    match (a state that is damaged, or as an older version wrote it, in a checkpoint whose files are
    whole)."""
    tag_dir = checkpoint.latest_dir(str(directory))
    g = parallel.Grid(world_size=1)
    blob = torch.load(checkpoint.model_file(tag_dir, g), weights_only=False)
    rank = torch.load(checkpoint.rank_file(tag_dir, g), weights_only=False)
    change(blob["run"]["state"])
    entries = checkpoint.write_files(tag_dir, blob["model"], blob["run"], rank, True, g)
    checkpoint.write_manifest(tag_dir, [entries], g)


def _copy(src, dst):
    import shutil

    return shutil.copytree(src, dst)


def test_the_keys_checked_are_the_run_states():
    """A key added to RunState without its entry (and a migration for older checkpoints) fails."""
    assert set(checkpoint.RUN_STATE_KEYS) == {
        f.name for f in dataclasses.fields(run_state.RunState)
    }
    assert set(STATE) == set(checkpoint.RUN_STATE_KEYS)
    assert set(checkpoint.MIGRATIONS) | set(checkpoint.REQUIRED) == set(checkpoint.RUN_STATE_KEYS)
    assert checkpoint.checked_run_state(STATE, CONFIG) == (STATE, [])


@pytest.mark.parametrize(
    "change, key, problem",
    [
        (
            {"consumed_samples": None},
            "consumed_samples",
            "is missing",
        ),  # None: deleted (an older version's, say)
        ({"iteration": -5}, "iteration", "is -5, not a count"),
        ({"iteration": "abc"}, "iteration", "is 'abc', not a count"),
        ({"history": {"loss": "x"}}, "history", "is {'loss': 'x'}, not"),
        (
            {"history": {"loss": "x", "grad norm": []}},
            "history",
            "['loss'] is 'x', not a list of numbers",
        ),
        (
            {"history": {"loss": [1.0], "grad norm": []}},
            "history",
            "holds 1 losses but 0 grad norms",
        ),
        ({"iteration": True}, "iteration", "is True, not a count"),
        ({"consumed_samples": 0}, "consumed_samples", "is 0 after 2 iterations"),
        ({"consumed_tokens": 8}, "consumed_tokens", "is 8 for 16 samples"),
        (
            {"consumed_tokens": 16 * 64 + 1},
            "consumed_tokens",
            "is 1025 for 16 samples of at most 64 tokens",
        ),
        (
            {"scheduler_samples": 17},
            "scheduler_samples",
            "is 17, more than the 16 consumed_samples",
        ),
        (
            {"optimizer_reset": {"iteration": 3, "warmup_iters": 5}},
            "optimizer_reset",
            "is {'iteration': 3, 'warmup_iters': 5}, not None or {'iteration': <= 2",
        ),
        ({"callbacks": []}, "callbacks", "is [], not a dict"),
        ({"hf_origin": "gpt2"}, "hf_origin", "is 'gpt2', not a dict or None"),
        ({"epoch": 3}, "epoch", "is no key of this version's run state"),
    ],
)
def test_a_damaged_run_state_is_refused_by_its_key(change, key, problem):
    state = {**STATE, **change}
    state = {
        k: v for k, v in state.items() if v is not None or k in ("optimizer_reset", "hf_origin")
    }
    with pytest.raises(
        ValueError,
        match=f"^checkpoint run state: {re.escape(key)} {re.escape(problem)}.*"
        "resume from an earlier checkpoint",
    ):
        checkpoint.checked_run_state(state, CONFIG)


def test_an_older_versions_state_is_migrated_by_name():
    """A run state as the first versions wrote it: the LR schedule's counters were the consumed
    ones; no history, no callbacks map (the spike guard's state alone), no hf_origin."""
    old = {
        "iteration": 2,
        "consumed_samples": 16,
        "consumed_tokens": 1024,
        "optimizer_reset": None,
        "spike_guard": {"decisions": []},
    }
    state, notes = checkpoint.checked_run_state(old, CONFIG)
    assert state["scheduler_samples"] == 16 and state["scheduler_tokens"] == 1024
    assert state["history"] == {"loss": [], "grad norm": []} and state["hf_origin"] is None
    assert state["callbacks"] == {"spike_guard": {"decisions": []}}
    filled = [
        re.match(
            r"run state: (\w+) missing \(a checkpoint of an older version\), filled by its "
            "migration: ",
            n,
        ).group(1)
        for n in notes
    ]
    assert filled == ["scheduler_samples", "scheduler_tokens", "history", "callbacks", "hf_origin"]
    loaded = run_state.RunState()
    loaded.load(old, CONFIG)
    assert loaded.scheduler_samples == 16 and loaded.callbacks == {"spike_guard": {"decisions": []}}


def test_samples_unlike_the_batch_schedule_are_said():
    """A resume may change global_batch_size, so 16 samples after 2 iterations of a 16-sample batch
    is said, not refused."""
    _, notes = checkpoint.checked_run_state(STATE, {**CONFIG, "global_batch_size": 16})
    assert notes == [
        "run state: consumed_samples is 16, where the checkpoint's batch schedule "
        "(global_batch_size 16, rampup_batch_size None) gives 32 after 2 iterations: the batch "
        "size changed during the run (or the run state is damaged); the data order goes on from "
        "sample 16"
    ]
    ramp = {
        **CONFIG,
        "global_batch_size": 16,
        "rampup_batch_size": [4, 4, 24],
    }  # batches 4, 4, 8, 12, 16
    ramped = {
        **STATE,
        "iteration": 5,
        "consumed_samples": 44,
        "consumed_tokens": 44,
        "scheduler_samples": 40,
        "scheduler_tokens": 40,
    }
    assert checkpoint.checked_run_state(ramped, ramp)[1] == []
    assert (
        "gives 44 after 5 iterations"
        in checkpoint.checked_run_state({**ramped, "consumed_samples": 40}, ramp)[1][0]
    )


def _files(directory):
    return {
        os.path.relpath(os.path.join(d, f), directory): os.path.getmtime(os.path.join(d, f))
        for d, _, fs in os.walk(directory)
        for f in fs
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("consumed_samples"), "consumed_samples is missing"),
        (lambda s: s.update(iteration=-5), "iteration is -5, not a count"),
        (lambda s: s.update(iteration="abc"), "iteration is 'abc', not a count"),
        (lambda s: s.update(history={"loss": "x"}), "history is {'loss': 'x'}, not"),
    ],
)
def test_a_resume_from_a_damaged_state_stops_before_anything_is_built(
    ckpt, tmp_path, change, message
):
    """The issue's cases: consumed_samples missing restarted the data order, iteration -5 trained
    iterations -4 to 4, the others were tracebacks. Now one message before the model is built, the
    checkpoint untouched."""
    directory = _copy(ckpt, tmp_path / "run")
    rewrite_state(directory, change)
    before = _files(directory)
    with pytest.raises(ValueError, match=f"^checkpoint run state: {re.escape(message)}"):
        run_main(*SMALL, "--train_iters=4", f"--save={directory}")
    assert _files(directory) == before


def test_the_command_exits_2_with_one_line(ckpt, tmp_path):
    directory = _copy(ckpt, tmp_path / "run")
    rewrite_state(directory, lambda s: s.pop("consumed_samples"))
    proc = run_cli(*SMALL, "--train_iters=4", f"--load={directory}", expect_ok=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: checkpoint run state: consumed_samples is missing")
    assert "Model size" not in proc.stdout


def test_a_resume_of_an_older_versions_state_says_its_migrations_and_goes_on(ckpt, tmp_path):
    directory = _copy(ckpt, tmp_path / "run")
    rewrite_state(
        directory,
        lambda s: [
            s.pop(k)
            for k in ("scheduler_samples", "scheduler_tokens", "history", "callbacks", "hf_origin")
        ],
    )
    out = run_main(*SMALL, "--train_iters=3", "--eval_iters=0", f"--save={directory}")
    for key in ("scheduler_samples", "scheduler_tokens", "history", "callbacks", "hf_origin"):
        assert (
            f"run state: {key} missing (a checkpoint of an older version), filled by its migration"
            in out
        )
    fields = log_fields(out)
    assert sorted(fields) == [3] and fields[3]["consumed samples"] == "24", (
        fields
    )  # the data order goes on


def test_a_negative_reset_warmup_is_refused_by_name(ckpt):
    """It was "lr=0 for -3 iterations", exit 0."""
    with pytest.raises(
        ValueError,
        match=r"^reset_optimizer_warmup_iters=-3 must be a positive number of lr=0 "
        r"iterations",
    ):
        run_main(*SMALL, "--train_iters=3", f"--load={ckpt}", "--reset_optimizer_warmup_iters=-3")
    # it reset nothing
    with pytest.raises(ValueError, match=r"^reset_optimizer_warmup_iters=0 must be a positive"):
        run_main(*SMALL, "--train_iters=3", f"--load={ckpt}", "--reset_optimizer_warmup_iters=0")
