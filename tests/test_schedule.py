"""The run's plan (schedule.py): the length of training, the LR shapes of the registry, warm-up-stable-decay."""

import math
import re

import pytest

import arguments
import schedule
import usage
from helpers import plan_of
from schedule import AnnealingLR


def plan(*argv):
    return plan_of(arguments.prepare(arguments.load_config(list(argv))))


@pytest.mark.parametrize("samples, iterations", [(96, 12), (97, 12), (103, 12), (104, 13)])
def test_train_samples_that_fill_whole_batches_run_every_batch(samples, iterations):
    """Megatron's update_train_iters: 96 samples of 8 are 12 iterations (a `>=` for `>` in Schedule.done stops at
    11); a last batch that would go past train_samples is not run."""
    p = plan(
        "--train_iters=none",
        f"--train_samples={samples}",
        "--global_batch_size=8",
        "--micro_batch_size=8",
        "--lr_warmup_samples=0",
    )
    assert p.total_iters == iterations and p.total_samples == 8 * iterations


def test_a_resume_s_totals_go_on_from_its_checkpoint():
    """A resume that changed the global batch or seq_length ends elsewhere than its config from iteration 0: the
    totals (the log's "N/ total", the data's length, the decay over the run) go on from the checkpoint's
    counters. From iteration 0 they were 6 iterations of 8 samples after 2 of 16 (a blend's index of 48 samples:
    an IndexError at iteration 5), and 4 iterations of 16 for a train_samples run of 64 after 2 of 8 (5 ran)."""
    keys = schedule.ScheduleConfig(
        global_batch_size=8, micro_batch_size=4, train_iters=6, lr_decay_samples=800
    )
    after_16 = {"iteration": 2, "consumed_samples": 32, "consumed_tokens": 32 * 64}
    whole = schedule.Schedule(keys, 1, 64, after_16)
    assert (whole.total_iters, whole.total_samples, whole.total_tokens) == (6, 64, 64 * 64)
    assert schedule.Schedule(keys, 1, 64).total_samples == 48  # from iteration 0
    by_samples = schedule.ScheduleConfig(
        global_batch_size=16, micro_batch_size=4, train_samples=64, lr_decay_samples=800
    )
    after_8 = {"iteration": 2, "consumed_samples": 16, "consumed_tokens": 16 * 32}
    assert schedule.Schedule(by_samples, 1, 32, after_8).total_iters == 5
    # a longer context after 12 iterations at 32: the tokens left, in samples of 64
    by_tokens = schedule.ScheduleConfig(
        global_batch_size=8, micro_batch_size=4, train_tokens=12 * 8 * 32 + 4 * 8 * 64
    )
    after_32 = {"iteration": 12, "consumed_samples": 96, "consumed_tokens": 12 * 8 * 32}
    longer = schedule.Schedule(by_tokens, 1, 64, after_32)
    assert (longer.total_iters, longer.total_samples) == (16, 128)


def test_cosine_and_linear_are_the_expression_megatron_computes_bit_for_bit():
    """Checkpoints and resumes are compared byte for byte: the registry must not reorder a float operation."""
    mx, mn, warmup, decay = 6e-5, 6e-6, 216_320, 126_953_125
    for style, coeff in (
        ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1.0)),
        ("linear", lambda r: 1.0 - r),
    ):
        s = AnnealingLR(mx, mn, style, warmup_samples=warmup, decay_samples=decay)
        for samples in range(warmup + 1, decay + 1, 999_983):
            ratio = (samples - warmup) / (decay - warmup)
            assert s.get_lr(samples, 0) == mn + coeff(ratio) * (mx - mn), (style, samples)
    assert AnnealingLR(mx, mn, "constant", warmup_samples=warmup).get_lr(10**9, 0) == mx


@pytest.mark.parametrize(
    "anneal, middle",
    [
        ("linear", 0.1 + 0.5 * 0.9),
        ("cosine", 0.1 + 0.5 * 0.9),
        ("exponential", 0.1 + (math.sqrt(2) - 1) * 0.9),  # 2 * 0.5^0.5 - 1
        ("minus_sqrt", 0.1 + (1 - math.sqrt(0.5)) * 0.9),
    ],
)
def test_wsd_warms_up_holds_then_anneals_over_its_last_samples(anneal, middle):
    """lr 1, min_lr 0.1, warm-up 100 samples, decay window to 1100 samples whose last 200 anneal (Megatron's
    --lr-wsd-decay-samples 200): the anneal starts at 900 and is half way at 1000."""
    s = AnnealingLR(
        1.0,
        0.1,
        "wsd",
        warmup_samples=100,
        decay_samples=1100,
        wsd_decay_samples=200,
        wsd_decay_style=anneal,
    )
    assert s.get_lr(50, 0) == 0.5  # the warm-up is the other shapes'
    assert s.get_lr(100, 0) == 1.0
    assert s.get_lr(500, 0) == 1.0 and s.get_lr(899, 0) == 1.0  # stable
    assert 0.1 < s.get_lr(901, 0) < 1.0
    assert s.get_lr(1000, 0) == pytest.approx(middle, rel=1e-12)
    assert s.get_lr(1100, 0) == pytest.approx(0.1, abs=1e-15) and s.get_lr(5000, 0) == 0.1
    assert "exponential" in schedule.WSD_ANNEALS and s.describe().endswith(
        "last 200 of 1100 samples"
    )


def test_wsd_from_the_config_and_its_refusals():
    p = plan("--lr_decay_style=wsd", "--lr_wsd_decay_samples=1600", "--lr_wsd_decay_style=linear")
    # tiny's lr_decay_samples: the anneal is its last 1600
    assert p.lr_schedule.decay_samples == 16_000
    for argv, message in [
        (["--lr_decay_style=wsd"], "lr_decay_style='wsd' needs lr_wsd_decay_samples"),
        (
            ["--lr_decay_style=wsd", "--lr_wsd_decay_samples=100", "--lr_wsd_decay_style=step"],
            "lr_wsd_decay_style='step' is not one of exponential, linear, cosine, minus_sqrt",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            arguments.validate(arguments.load_config(argv))
    with pytest.raises(ValueError, match="lr_wsd_decay_samples"):  # longer than the decay window
        plan("--lr_decay_style=wsd", "--lr_wsd_decay_samples=20000")


SAMPLES = ["--train_iters=none", "--train_samples=1000", "--micro_batch_size=4"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--lr_decay_samples=8000", "--lr_decay_tokens=1000000"],
            "both lr_decay_samples and lr_decay_tokens are set; set only one of them",
        ),
        (
            ["--total_curriculum_step=100"],
            "total_curriculum_step=100 does nothing without curriculum_learning",
        ),
        (["--min_difficulty=32"], "min_difficulty=32 does nothing without curriculum_learning"),
        (
            ["--lr_wsd_decay_samples=1600"],
            "lr_wsd_decay_samples=1600 does nothing without lr_decay_style='wsd' (here lr_decay_style='cosine')",
        ),
        (
            ["--lr_wsd_decay_style=linear"],
            "lr_wsd_decay_style='linear' does nothing without lr_decay_style='wsd'",
        ),
        (
            [*SAMPLES, "--global_batch_size=none", "--rampup_batch_size=4 4 64"],
            "rampup_batch_size starts at 4 = global_batch_size (unset: micro_batch_size x data-parallel size): "
            "there is nothing to ramp",
        ),
        (
            [*SAMPLES, "--global_batch_size=16", "--rampup_batch_size=16 4 64"],
            "rampup_batch_size starts at 16 = global_batch_size: there is nothing to ramp",
        ),
        (
            [*SAMPLES, "--global_batch_size=16", "--train_samples=8"],
            "train_samples=8 is less than the first global batch (16): no iteration would run",
        ),
        (
            [
                *SAMPLES,
                "--global_batch_size=16",
                "--rampup_batch_size=12 4 64",
                "--train_samples=8",
            ],
            "train_samples=8 is less than the first global batch (12)",
        ),
    ],
)
def test_keys_the_run_would_ignore_are_refused(argv, message):
    """Each was accepted and did something else than asked: the tokens' decay won over the samples' (set in a
    config file: tr1_13b.py), a curriculum or WSD key trained without it, a ramp-up from the global batch stayed
    there (an unset global batch is one micro-batch per rank), train_samples below the first batch ran 0
    iterations and exited 0."""
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(argv))


def test_a_ramp_up_runs_from_its_first_batch():
    """What train_samples is measured against: the ramp-up's first batch, not the global one."""
    p = plan(*SAMPLES, "--global_batch_size=16", "--rampup_batch_size=4 4 64", "--train_samples=8")
    assert (p.total_iters, p.total_samples) == (2, 8)


def test_a_warm_up_the_run_ends_inside_is_a_warning_line():
    """Megatron runs it, and so does this code (a short trial of a large config's first iterations); the
    schedule's description says the learning rate never reaches lr."""
    short = plan("--lr_warmup_samples=6000", "--train_iters=2")
    assert short.describe().splitlines()[1] == (
        "warning: the warm-up lr_warmup_samples=6,000 is longer than the run (32 samples): the learning rate "
        "never reaches lr=0.002"
    )
    assert "warning" not in plan("--lr_warmup_samples=32", "--train_iters=2").describe()
    tokens = plan("--lr_warmup_tokens=5000", "--lr_decay_tokens=100000", "--train_iters=2")
    assert "lr_warmup_tokens=5,000 is longer than the run (4,096 tokens)" in tokens.describe()


def test_a_skip_range_after_the_runs_end_is_a_warning_line():
    """A range of a longer run's config skipped nothing, in silence."""
    p = plan(
        "--lr_warmup_samples=0",
        "--train_iters=5",
        "--skip_train_iteration_range",
        "9-12",
        "5-6",
        "6-7",
    )
    assert p.describe().splitlines()[1:] == [
        "warning: skip_train_iteration_range 9-12 starts after the run's last iteration 5: nothing of it is skipped",
        "warning: skip_train_iteration_range 6-7 starts after the run's last iteration 5: nothing of it is skipped",
    ]


def test_wsd_is_checked_on_resume_and_other_shapes_save_what_they_saved():
    cosine = AnnealingLR(1.0, 0.1, "cosine", warmup_samples=100, decay_samples=1100)
    assert set(cosine.state_dict()) == {
        "max_lr",
        "min_lr",
        "warmup_samples",
        "warmup_tokens",
        "decay_samples",
        "decay_tokens",
        "decay_style",
        "warmup_end_tokens",
    }
    wsd = dict(max_lr=1.0, min_lr=0.1, decay_style="wsd", warmup_samples=100, decay_samples=1100)
    saved = AnnealingLR(**wsd, wsd_decay_samples=200).state_dict()
    with pytest.raises(ValueError, match="for wsd decay samples do not match"):
        AnnealingLR(**wsd, wsd_decay_samples=300).load_state_dict(saved, override=False)
    AnnealingLR(**wsd, wsd_decay_samples=200).load_state_dict(saved, override=False)


def test_help_and_the_resume_check_read_the_registry():
    meaning = {name: text for _, _, name, _, _, text in usage.config_fields()}
    assert all(style in meaning["lr_decay_style"] for style in schedule.LR_SHAPES)
    assert all(anneal in meaning["lr_wsd_decay_style"] for anneal in schedule.WSD_ANNEALS)
    assert {"lr_decay_style", "lr_wsd_decay_samples", "lr_wsd_decay_style"} <= set(schedule.LR_KEYS)
    assert set(schedule.LR_KEYS) <= set(arguments.FIELDS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--curriculum_learning", "--total_curriculum_step=10", "--min_difficulty=60"],
            "min_difficulty 60 must be a positive multiple of difficulty_step 8",
        ),
        (
            ["--lr_warmup_samples=20000"],
            "lr_decay_samples (16000) must be larger than lr_warmup_samples (20000)",
        ),
        # a key the config does not set, named: where its value came from
        (
            ["--lr_warmup_samples=6400", "--lr_decay_samples=none", "--train_iters=2"],
            "(lr_decay_samples is unset: the decay runs over the run's 32 samples; lengthen the run",
        ),
        (
            [
                "--train_iters=none",
                "--train_samples=100",
                "--global_batch_size=16",
                "--rampup_batch_size=4 5 64",
            ],
            "global_batch_size - start = 12 is not a multiple of the increment 5",
        ),
    ],
)
def test_what_only_the_schedule_checks_is_refused_by_the_configs_check(argv, message):
    """The ramp-up's batches, the curriculum's lengths and the LR's warm-up against its decay were checked when
    the Schedule was made: after the process group and the save directory (left behind, empty)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(["--micro_batch_size=2", *argv]))
