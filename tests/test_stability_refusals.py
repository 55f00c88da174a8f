"""The stability keys' refusals (issue #48): a key that cannot work is refused before any work, in
one message that names it and says what to give instead; train.py exits 2."""

import os

import pytest

import arguments
from helpers import SMALL, corpus, corpus512, run_cli, run_main  # noqa: F401 (corpus, corpus512: fixtures)


def error(*argv):
    with pytest.raises(ValueError) as e:
        arguments.prepare(arguments.load_config(list(argv)))
    return str(e.value)


def test_a_bit_outside_the_flipped_elements_width_is_refused():
    """Bit 99 was taken modulo the width (bit 3 of an fp32 gradient) and flipped in silence."""
    flip = ["--inject_bitflip_iters=10-10"]
    assert "inject_bitflip_bit=99 is not a bit of the 32-bit element" in error(
        *flip, "--inject_bitflip_bit=99"
    )
    assert "give 0-31, or -1 for the top exponent bit" in error(*flip, "--inject_bitflip_bit=32")
    assert "inject_bitflip_bit=-2" in error(*flip, "--inject_bitflip_bit=-2")
    # a half-precision weight has 16 bits; its fp32 master 32
    assert "of the 16-bit element" in error(
        *flip, "--bf16", "--inject_bitflip_target=weight", "--inject_bitflip_bit=20"
    )
    for ok in (
        ["--inject_bitflip_bit=-1"],
        ["--inject_bitflip_bit=31"],
        ["--bf16", "--inject_bitflip_target=master", "--inject_bitflip_bit=30"],
        ["--fp16", "--inject_bitflip_target=weight", "--inject_bitflip_bit=15"],
    ):
        arguments.prepare(arguments.load_config([*flip, *ok]))


def test_a_precursor_threshold_without_the_precursor_is_refused():
    """The threshold alone did nothing, in silence: the rung is off without the precursor."""
    message = error("--spike_guard_precursor_threshold=3")
    assert message.startswith(
        "spike_guard_precursor_threshold=3.0 does nothing without spike_guard_precursor"
    ), message
    rung = [
        "--spike_guard_precursor=log_z",
        "--telemetry_interval=5",
        "--spike_guard_precursor_threshold=3",
    ]
    arguments.prepare(arguments.load_config(rung))


def test_a_guard_without_snapshots_or_a_checkpoint_cadence_is_refused():
    """With spike_guard_snapshot_interval=0 the guard's states are the disk checkpoints, and its update size reads
    at each: with save but no save_interval it had one checkpoint (the last) and no reading, in silence."""
    guard = ["--spike_guard", "--spike_guard_snapshot_interval=0"]
    needed = "rolls back to disk checkpoints: set save and save_interval"
    assert needed in error(*guard, "--save=none", "--save_interval=none")
    assert needed in error(*guard, "--save=/tmp/ck", "--save_interval=none")
    arguments.prepare(arguments.load_config([*guard, "--save=/tmp/ck", "--save_interval=50"]))


def test_a_snapshot_dir_that_cannot_be_created_is_refused_before_training(tmp_path, corpus512):
    """Its parent a file: a bare NotADirectoryError (errno 20) came from the snapshots' makedirs,
    naming no key."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "snapshots"
    guard = ["--spike_guard", "--spike_guard_snapshot_interval=5"]
    message = error(*guard, f"--spike_guard_snapshot_dir={bad}")
    assert message.startswith(
        f"spike_guard_snapshot_dir={bad} cannot be created: {blocker} is a file"
    ), message
    assert f"spike_guard_snapshot_dir={blocker} is not a directory" in error(
        *guard, f"--spike_guard_snapshot_dir={blocker}"
    )
    new = tmp_path / "new" / "deeper"
    arguments.prepare(arguments.load_config([*guard, f"--spike_guard_snapshot_dir={new}"]))
    assert not os.path.exists(tmp_path / "new")  # checked, not created: the run creates it
    # the real command line: exit 2, the one message, no iteration run
    proc = run_cli(
        "--num_layers=1",
        "--hidden_size=32",
        "--num_attention_heads=2",
        "--seq_length=32",
        "--vocab_size=512",
        "--train_iters=5",
        "--save=none",
        "--save_interval=none",
        f"--data_path={corpus512}",
        *guard,
        f"--spike_guard_snapshot_dir={bad}",
        expect_ok=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "spike_guard_snapshot_dir=" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and " iteration " not in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        # every update skipped: a run that never moved, exit 0
        (["--skip_grad_norm_above=0"], "skip_grad_norm_above=0.0 must be positive"),
        # gradient ascent in the fault's iterations; a factor of 1 injected nothing
        (
            ["--inject_lr_iters=2-3", "--inject_lr_factor=-5"],
            "inject_lr_factor=-5.0 must be positive and not 1",
        ),
        (
            ["--inject_lr_iters=2-3", "--inject_lr_factor=1"],
            "inject_lr_factor=1.0 must be positive and not 1",
        ),
        (
            ["--inject_bitflip_iters=2-2", "--inject_bitflip_element=-5"],
            "inject_bitflip_element=-5 must be",
        ),
        # behaved as 0, in silence
        (
            ["--spike_guard", "--spike_guard_max_rollbacks=-1"],
            "spike_guard_max_rollbacks and spike_guard_max",
        ),
        # a ZeroDivisionError traceback
        (["--tensor_model_parallel_size=0"], "tensor_model_parallel_size=0 must be positive"),
        # refused by the data's build, after the model's
        (
            ["--skip_documents=/no/such/list.jsonl"],
            "skip_documents file /no/such/list.jsonl not found",
        ),
    ],
)
def test_a_value_no_run_can_mean_is_refused_before_the_build(argv, message):
    assert message in error("--train_iters=5", *argv)


def test_a_fault_after_the_runs_end_is_a_warning_line():
    """A longer run's fault kept in a config struck nothing, in silence (skip ranges and profile_steps say so)."""
    from sections import section
    from stability.faults import Faults, FaultsConfig

    cfg = arguments.load_config(
        [
            "--train_iters=5",
            "--inject_lr_iters=50-60",
            "--inject_bad_device_iter=100",
            "--inject_bitflip_iters=3-3",
            "--inject_bad_samples=1000-2000",
        ]
    )
    faults = Faults(section(FaultsConfig, cfg), None, 1, 512)
    assert faults.after_the_end(5, 80) == [
        "warning: inject_lr_iters starts after the run's last iteration 5: it strikes nothing",
        "warning: inject_bad_device_iter starts after the run's last iteration 5: it strikes nothing",
        "warning: inject_bad_samples starts after the run's 80 samples: it strikes nothing",
    ]
    assert (
        Faults(section(FaultsConfig, arguments.load_config([])), None, 1, 512).after_the_end(5, 80)
        == []
    )


def test_a_telemetry_interval_no_iteration_of_the_run_meets_is_a_warning_line(corpus):
    """A longer run's interval kept in a config recorded nothing, in silence."""
    out = run_main(*SMALL, "--train_iters=3", "--telemetry_interval=10")
    assert (
        "warning: telemetry_interval 10: no iteration of this run (1-3) is a multiple of it" in out
    )
    assert "telemetry_interval" not in run_main(*SMALL, "--train_iters=3", "--telemetry_interval=3")


def test_a_run_shorter_than_the_detectors_warm_up_is_a_warning_line(corpus, tmp_path):
    """A longer run's spike_guard_min_steps kept in a config: the detector judged no step, in silence. A resumed
    run counts the steps its checkpoint's detector holds."""
    out = run_main(*SMALL, "--train_iters=3", "--spike_guard", f"--save={tmp_path}")
    assert (
        "warning: spike_guard_min_steps 16: this run's 3 iterations after the 0 steps its detector holds do not "
        "reach it: the spike guard's detector judges no step of this run"
    ) in out
    guarded = ["--spike_guard", "--spike_guard_min_steps=4"]
    assert "warning: spike_guard_min_steps" not in run_main(*SMALL, "--train_iters=4", *guarded)
    resumed = run_main(*SMALL, "--train_iters=4", *guarded, f"--save={tmp_path}")
    assert "warning: spike_guard_min_steps" not in resumed  # 3 held + 1
