"""report.py knows no callback by name: a list a callback records (its decisions) accumulates
over the iteration in metrics.jsonl, whatever its key; any other value is the iteration's last."""

import json
import os

import pytest

import report
from helpers import corpus, corpus512, guard_model_args, run_python  # noqa: F401 (fixtures)


def test_a_callbacks_list_accumulates_whatever_its_key(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = report.MetricsFile(str(path))
    metrics.add(3, {"spike guard": [{"rung": 1}], "lm loss": 2.0})
    metrics.add(3, {"remedy shrink": [{"iteration": 3}], "spike guard": [{"rung": 2}]})
    metrics.add(3, {"remedy shrink": [{"iteration": 3, "again": True}], "lm loss": 1.5})
    metrics.add(4, {"replica check": [{"reason": "a"}]})
    metrics.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {
            "iteration": 3,
            "spike guard": [{"rung": 1}, {"rung": 2}],
            "lm loss": 1.5,
            "remedy shrink": [{"iteration": 3}, {"iteration": 3, "again": True}],
        },
        {"iteration": 4, "replica check": [{"reason": "a"}]},
    ]


@pytest.mark.parametrize(
    "before", ['{"iteration": 1, "lm loss": 5.0}\n{"iteration": 2, "lm lo', '{"itera']
)
def test_a_record_cut_by_a_kill_is_dropped_before_the_resumed_run_appends(tmp_path, before):
    """A kill inside a write left a line without its newline; the resumed run's first record ran into it and
    the file no longer read (tools/plot.py, tools/precursors.py: a JSONDecodeError)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(before)
    metrics = report.MetricsFile(str(path))
    metrics.add(2, {"lm loss": 4.0})
    metrics.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[-1] == {"iteration": 2, "lm loss": 4.0}
    assert records[:-1] == (
        [{"iteration": 1, "lm loss": 5.0}] if before.startswith('{"iteration": 1') else []
    )


def test_read_metrics_ends_on_the_last_timeline_and_keeps_every_decision(tmp_path):
    """A resume from a checkpoint older than the file's last records, or a rollback, runs iterations again: the
    file's later records of the old timeline were read as the run's (readers kept the last record of an iteration,
    and merged keys across timelines; an iteration the new timeline had not reached kept the dead one's numbers)."""
    path = tmp_path / "metrics.jsonl"
    metrics = report.MetricsFile(str(path))
    assert not metrics.held_records
    for i in (1, 2, 3, 4):
        metrics.add(i, {"lm loss": 10.0 - i, "old": True} | ({"skipped": "x"} if i == 4 else {}))
    metrics.add(4, {"spike guard": [{"iteration": 4, "action": "rollback"}]})
    metrics.timeline(2, "rollback")
    metrics.add(2, {"validation lm loss": 7.5})  # iteration 2 itself stands: its records merge
    metrics.add(3, {"lm loss": 3.0})
    metrics.add(3, {"spike guard": [{"iteration": 3, "action": "skip"}]})
    metrics.close()
    resumed = report.MetricsFile(
        str(path)
    )  # a resume from iteration 1's checkpoint: 2 and 3 abandoned
    assert resumed.held_records
    resumed.timeline(1, "resume")
    resumed.add(2, {"lm loss": 2.5})
    resumed.close()
    assert report.read_metrics(str(path)) == {
        1: {"iteration": 1, "lm loss": 9.0, "old": True},
        2: {"iteration": 2, "lm loss": 2.5},
        3: {"iteration": 3, "spike guard": [{"iteration": 3, "action": "skip"}]},
        4: {"iteration": 4, "spike guard": [{"iteration": 4, "action": "rollback"}]},
    }
    with open(path, "a") as f:
        f.write('{"iteration": 3, "lm lo')  # a run writing it
    assert report.read_metrics(str(path))[3] == {
        "iteration": 3,
        "spike guard": [{"iteration": 3, "action": "skip"}],
    }


def test_a_wandb_mode_wandb_does_not_know_is_refused_before_the_run():
    """wandb_mode=offlin was wandb's page of pydantic errors, naming no key, after the model's build."""
    import arguments

    cfg = arguments.load_config(["--wandb_project=p", "--wandb_mode=offlin"])
    with pytest.raises(
        ValueError, match=r"^wandb_mode='offlin' is not offline, online or disabled"
    ):
        arguments.validate(cfg, reads_data=False)
    for mode in ("offline", "online", "disabled"):
        arguments.validate(
            arguments.load_config(["--wandb_project=p", f"--wandb_mode={mode}"]), reads_data=False
        )


def test_wandb_keeps_the_iterations_a_rollback_runs_again(corpus512, tmp_path):
    """wandb's step only increases: what is logged at a lower one is dropped ("Tried to log to step 36 that is less
    than the current step 41 ... this data will be ignored"), and after the guard's rollback every iteration it ran
    again was. The iteration is a value, the x axis of every scalar (define_metric)."""
    import glob

    guarded = ["--spike_guard", "--spike_guard_window=20", "--spike_guard_min_steps=10"]
    guarded += [
        "--spike_guard_rewind=3",
        "--spike_guard_snapshot_interval=5",
        "--spike_guard_update_ratio=0",
    ]
    fault = ["--inject_lr_iters=40-45", "--inject_lr_factor=1000"]
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1", WANDB_SILENT="false")
    args = [
        *guard_model_args(corpus512),
        *guarded,
        *fault,
        "--wandb_project=p",
        f"--save={tmp_path}",
    ]
    done = run_python(1, ["train.py", *args], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spike guard: rolled back to iteration 35" in done.stdout
    said = done.stdout + done.stderr
    assert "monotonically increasing" not in said and "will be ignored" not in said
    assert (
        len(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))) == 1
    )  # it logged
