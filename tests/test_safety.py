"""Friendly and safe at the edges: --help, resuming without losing a run, SIGTERM, bad input, sampling, eval."""

import errno
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import arguments
import checkpoint
import data
import loader
import safety
import usage
from helpers import (  # noqa: F401 (corpus, corpus_copy: fixtures)
    ROOT,
    SMALL,
    corpus,
    corpus_copy,
    log_fields,
    losses,
    run_cli,
    run_main,
    spawn,
)
from sections import section

ENV = dict(os.environ, WANDB_MODE="disabled")


def _latest(directory):
    return open(os.path.join(directory, "latest")).read().strip()


@pytest.fixture(scope="module")
def ckpt(corpus, tmp_path_factory):
    """A 2-iteration checkpoint of the SMALL model; tests copy it before writing into it."""
    directory = tmp_path_factory.mktemp("ckpt")
    run_main(*SMALL, "--train_iters=2", f"--save={directory}")
    return directory


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _files(directory):
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, _, fs in os.walk(directory)
        for f in fs
        if "tensorboard" not in d
    )


# -- 1. --help --------------------------------------------------------------------------------------------------


def test_help_lists_every_key_with_type_default_and_meaning_without_importing_torch():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not re.search(r"\|\s+torch$", proc.stderr, re.M), "--help imported torch"
    out = proc.stdout
    for name in arguments.FIELDS:
        assert re.search(rf"^  --{name} ", out, re.M), name
    for group in usage.ORDER:
        assert re.search(rf"^{group}\b", out, re.M), group
    # read from the source, it matches the real dataclass: same keys, same defaults, a meaning for each
    parsed = usage.config_fields()
    assert [f[2] for f in parsed] == list(arguments.FIELDS)
    for group, _, name, _kind, default, meaning in parsed:
        assert meaning, f"{name} has no comment"
        assert group in usage.ORDER, (name, group)
        assert eval(default) == arguments.FIELDS[name].default, name
    assert run_cli("-h").stdout == out
    with pytest.raises(SystemExit) as exit_:
        arguments.load_config(["--lr=1", "--help"])
    assert exit_.value.code == 0


# -- 2. resume ---------------------------------------------------------------------------------------------------


def test_rerun_resumes_from_save_and_never_moves_latest_back(ckpt, tmp_path):
    directory = _copy(ckpt, tmp_path / "run")
    # the same command, longer: resumes
    out = run_main(*SMALL, "--train_iters=3", f"--save={directory}")
    assert "resuming from" in out and "train_iters: 2 -> 3" in out
    assert sorted(log_fields(out)) == [3] and _latest(directory) == "global_step3"
    other = tmp_path / "elsewhere"
    other.mkdir()
    before = _files(directory)
    with pytest.raises(ValueError, match="already holds checkpoint global_step3"):
        run_main(*SMALL, "--train_iters=2", f"--save={directory}", f"--load={other}")
    assert _latest(directory) == "global_step3" and _files(directory) == before


@pytest.mark.parametrize(
    "change, message",
    [
        (["--num_attention_heads=2"], "num_attention_heads 4 (checkpoint) vs 2 (now)"),
        (["--activation=relu"], "activation 'gelu' (checkpoint) vs 'relu' (now)"),
        (
            ["--num_layers=3", "--seq_length=32"],
            "num_layers 2 (checkpoint) vs 3 (now), seq_length 64 (checkpoint) vs 32 (now)",
        ),
    ],
)
def test_resume_with_another_model_is_refused_before_loading(ckpt, change, message):
    before = _files(ckpt)
    with pytest.raises(ValueError, match=re.escape(message)):
        run_main(*SMALL, "--train_iters=4", f"--load={ckpt}", f"--save={ckpt}", *change)
    assert _files(ckpt) == before


def test_a_rotary_model_resumes_at_a_longer_context_not_a_shorter_one(tmp_path):
    """Rotary and ALiBi positions are computed, not a table of seq_length rows: a longer seq_length on resume is
    the same weights (a context-extension stage, as Megatron's resume allows), and was refused as another model.
    A shorter one is refused with the reason; learned positions' table is the length."""
    rotary = [*SMALL, "--position_embedding_type=rotary", "--lr=1e-2", "--lr_warmup_samples=8"]
    save = f"--save={tmp_path / 'run'}"
    trained = losses(run_main(*rotary, "--seq_length=32", "--train_iters=12", save))
    fresh = losses(run_main(*rotary, "--train_iters=1"))  # at 64, from the initialisation
    out = run_main(*rotary, "--train_iters=13", save)
    assert (
        "seq_length: 32 -> 64 (a longer context, the same weights: the data goes on at the same sample count"
    ) in out and "loaded checkpoint" in out
    assert log_fields(out)[13]["consumed tokens"] == str(12 * 8 * 32 + 8 * 64)
    # the checkpoint's weights, not a new model's: the loss goes on from where the short context left it
    assert float(losses(out)[13]) < float(fresh[1]) - 1 and float(trained[12]) < float(fresh[1]) - 1
    # the next resume at the new length checks its counters against it (tokens <= samples x seq_length)
    assert "seq_length:" not in run_main(*rotary, "--train_iters=14", save)
    with pytest.raises(ValueError, match=re.escape("may grow on resume, not shrink")):
        run_main(*rotary, "--seq_length=32", "--train_iters=15", save)
    current = arguments.to_dict(arguments.prepare(arguments.load_config(SMALL)))
    with pytest.raises(
        ValueError, match=re.escape("another model: seq_length 64 (checkpoint) vs 128 (now).")
    ):
        safety.compare_configs(current, {**current, "seq_length": 128}, "ckpt")  # learned


def test_a_resume_with_a_smaller_global_batch_trains_to_its_end_on_a_blend(
    corpus, corpus_copy, tmp_path
):
    """The data's length and the log's total were the config's from iteration 0 (6 x 8 samples), not the run's
    (2 x 16, then 4 x 8): a blend's index of 48 samples, an IndexError at iteration 5 (Megatron sizes its blend
    the same way)."""
    blend = ["--data_path", "0.5", corpus, "0.5", corpus_copy]
    args = [*SMALL, *blend, "--train_iters=6", f"--save={tmp_path}", "--micro_batch_size=8"]
    run_main(*args, "--global_batch_size=16", "--exit_interval=2")
    out = run_main(*args, "--global_batch_size=8")
    assert "training for 6 iterations, 64 samples" in out
    fields = log_fields(out)
    assert sorted(fields) == [3, 4, 5, 6] and fields[6]["consumed samples"] == "64"
    assert re.search(r" iteration +6/ +6 \|", out)


def test_a_checkpoint_of_another_version_is_compared_key_by_key(ckpt, tmp_path):
    """A key the checkpoint's version did not have was skipped (qk_layernorm asked of an old checkpoint: a
    traceback at the state dict's load; a switch without parameters: trained silently), a key this version
    does not know was dropped without a word. The attention switches that compute the same function
    (attention_backend, unfused_attention, apply_query_key_layer_scaling, stable_attention) may change."""
    current = arguments.to_dict(arguments.prepare(arguments.load_config(SMALL)))
    old = {k: v for k, v in current.items() if k not in ("qk_layernorm", "stable_attention")}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "holds another model: qk_layernorm False (checkpoint: its default) vs True (now)"
        ),
    ):
        safety.compare_configs(old, {**current, "qk_layernorm": True}, "ckpt")
    newer = {**current, "attention_logit_softcap": 30.0}
    assert safety.compare_configs(newer, current, "ckpt") == [
        "attention_logit_softcap: 30.0 (a key this version does not know: ignored)"
    ]
    same_function = {
        "unfused_attention": True,
        "stable_attention": True,
        "attention_backend": "math",
    }
    assert safety.compare_configs(current, {**current, **same_function}, "ckpt") == [
        "attention_backend: 'auto' -> 'math'",
        "unfused_attention: False -> True",
        "stable_attention: False -> True",
    ]


def test_a_resume_that_changes_the_data_order_says_what_it_does():
    """seed, split or the blend changed on resume (Megatron allows it; a later phase's mix does it on purpose): the
    run goes on at its sample count in another order, which the changed-keys line now says."""
    current = arguments.to_dict(arguments.prepare(arguments.load_config(SMALL)))
    said = " (the training data's order follows it: the run goes on at its sample count in the new order, "
    assert safety.compare_configs(current, {**current, "seed": 42, "split": "98,2,0"}, "ckpt") == [
        "split: '949,50,1' -> '98,2,0'"
        + said
        + "which may give samples already read and skip others)",
        "seed: 1234 -> 42" + said + "which may give samples already read and skip others)",
    ]


def test_an_optimizer_state_the_run_cannot_continue_is_refused_before_the_build(ckpt, monkeypatch):
    """Changed Adam settings, or fp32 masters the run does not have, were refused after the model's build (at
    176B: minutes of every rank's time); no_load_optim, override_adam_params or an optimizer reset due now
    take the same resume on."""
    import builders

    def build(*args, **kwargs):
        raise AssertionError("built before the refusal")

    monkeypatch.setattr(builders, "build", build)
    for change, message in [
        (["--adam_beta2=0.99"], "other Adam settings than this config (adam_beta2 0.95 -> 0.99)"),
        (
            ["--bf16"],
            "optimizer state is from an fp32 run, this run is fp16/bf16: the fp32 master weights",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            run_main(*SMALL, f"--load={ckpt}", "--train_iters=3", *change)
    for allowed in (
        ["--adam_beta2=0.99", "--override_adam_params"],
        ["--bf16", "--no_load_optim"],
        ["--adam_beta2=0.99", "--reset_optimizer_warmup_iters=2"],
    ):
        with pytest.raises(AssertionError, match="built before the refusal"):
            run_main(*SMALL, f"--load={ckpt}", "--train_iters=3", *allowed)


def test_a_resume_that_switches_deepspeed_needs_a_fresh_optimizer():
    """A native checkpoint resumed with deepspeed=True listed the change, then failed inside DeepSpeed after the
    build ("Empty ds_version in checkpoint"): the two paths keep the optimizer's state apart."""
    current = arguments.to_dict(arguments.prepare(arguments.load_config(SMALL)))
    with pytest.raises(
        ValueError, match=re.escape("holds the native path's optimizer state, which deepspeed=True")
    ):
        safety.compare_configs(current, {**current, "deepspeed": True}, "ckpt")
    with pytest.raises(
        ValueError, match=re.escape("holds DeepSpeed's optimizer state, which deepspeed=False")
    ):
        safety.compare_configs({**current, "deepspeed": True}, current, "ckpt")
    fresh = {**current, "deepspeed": True, "no_load_optim": True}
    assert "deepspeed: False -> True" in safety.compare_configs(current, fresh, "ckpt")


def test_a_resume_past_the_end_or_skipping_what_it_trained_is_refused_with_the_fix(ckpt, tmp_path):
    """Each exited 0 having done nothing, or skipped nothing, and said nothing: train_iters (or train_tokens)
    below the checkpoint's; a new skip_train_iteration_range before it (lesson 9's rollback with latest left as
    it was). A range the checkpoint's own run had already skipped is no change; one partly before it is said."""
    run = _copy(ckpt, tmp_path / "run")  # at iteration 2
    for change, message in [
        (
            ["--train_iters=1"],
            "is past the end of training: train_iters=1, and it is at 2; raise train_iters",
        ),
        (
            # 2 iterations of 8 x 64 tokens
            ["--train_iters=none", "--train_tokens=600"],
            "is past the end of training: train_tokens=600, and it is at 1024; raise train_tokens",
        ),
        (
            ["--train_iters=4", "--skip_train_iteration_range", "1-2"],
            "skip_train_iteration_range 1-2 ends at or before the checkpoint's iteration 2: those batches are "
            "trained on already; to skip them, roll back: write the tag of a checkpoint before iteration 1",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            run_main(*SMALL, f"--save={run}", *change)
    assert _latest(run) == "global_step2"
    # a run of train_tokens=600 ends at 1024 tokens, its first batch at or past 600: complete, not past the end
    state = {"iteration": 2, "consumed_samples": 16, "consumed_tokens": 1024}
    assert safety.what_is_left(state, {"train_tokens": 600}, {"train_tokens": 600}, "ck") == [
        "checkpoint ck is at train_tokens=600: the run is complete, nothing to train"
    ]
    out = run_main(*SMALL, f"--save={run}", "--train_iters=2")
    assert (
        f"checkpoint {run / 'global_step2'} is at train_iters=2: the run is complete, nothing to train"
        in out
    )
    out = run_main(
        *SMALL, f"--save={run}", "--train_iters=4", "--skip_train_iteration_range", "2-3"
    )
    assert (
        "skip_train_iteration_range 2-3: iterations 2-2 are trained on already (the checkpoint's iteration is 2); "
        "3-3 are skipped" in out
    )
    # resumed again with the same range: the checkpoint's own run skipped it, nothing to say
    out = run_main(
        *SMALL, f"--save={run}", "--train_iters=5", "--skip_train_iteration_range", "2-3"
    )
    assert "skip_train_iteration_range 2-3" not in out and _latest(run) == "global_step5"


def test_a_run_length_that_sets_the_lr_decay_is_said_to_need_override_lr_scheduler():
    """With lr_decay_samples unset the decay runs over the run's length: a changed train_iters was listed as a
    plain change, then refused after the build as "decay samples do not match", a key the user never set."""
    current = arguments.to_dict(
        arguments.prepare(arguments.load_config([*SMALL, "--lr_decay_samples=none"]))
    )
    saved = {**current, "train_iters": 2}
    assert safety.compare_configs(saved, current, "ckpt") == [
        f"train_iters: 2 -> {current['train_iters']} (needs override_lr_scheduler): with lr_decay_samples unset "
        "the LR decays over the run's length"
    ]
    fixed = {**saved, "lr_decay_samples": 800}
    assert safety.compare_configs(fixed, {**current, "lr_decay_samples": 800}, "ckpt") == [
        f"train_iters: 2 -> {current['train_iters']}"
    ]


def test_a_changed_lr_schedule_is_refused_before_the_model_is_built(corpus, tmp_path):
    """AnnealingLR compares the checkpoint's schedule with the config's by value (Megatron's check) when the
    run state is restored, after the build: minutes on every rank of a large model. Now at the resume's check,
    with why when the decay follows the run's length."""
    args = [
        *SMALL,
        "--lr_decay_samples=none",
        "--lr_warmup_samples=0",
        f"--save={tmp_path}",
        "--eval_iters=0",
    ]
    run_main(*args, "--train_iters=2")
    proc = run_cli(*args, "--train_iters=4", expect_ok=False)
    assert proc.returncode == 2 and "Model size" not in proc.stdout
    assert proc.stderr.strip().endswith(
        "for decay samples do not match; to use the config's schedule from the current consumed samples/tokens, "
        "set override_lr_scheduler (--override-lr-scheduler) (lr_decay_samples is unset: the decay follows the "
        "length of the run)"
    )
    assert sorted(log_fields(run_main(*args, "--train_iters=4", "--override_lr_scheduler"))) == [
        3,
        4,
    ]


def test_another_model_exits_2_with_one_line(ckpt):
    proc = run_cli(*SMALL, "--train_iters=4", f"--load={ckpt}", "--num_layers=3", expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        and "num_layers 2 (checkpoint)" in proc.stderr
    )


def test_missing_load_directory_is_an_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="load directory .*nothing does not exist"):
        run_main(*SMALL, "--train_iters=2", f"--load={tmp_path}/nothing")


@pytest.mark.slow
def test_sigterm_saves_and_exits_0_then_the_rerun_resumes(corpus, tmp_path):
    """A real SIGTERM to a training process (what SLURM sends before its time limit)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *SMALL,
            "--train_iters=1000",
            f"--save={tmp_path}",
            "--exit_signal_handler",
            "--eval_iters=0",
        ],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(" iteration        2/"):
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(lines) + proc.stdout.read()
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    finally:
        proc.kill()
    last = max(log_fields(out))
    assert f"exiting at iteration {last} (SIGTERM" in out
    assert _latest(tmp_path) == f"global_step{last}" and not os.path.exists(tmp_path / "lock")
    resumed = run_main(*SMALL, f"--train_iters={last + 1}", f"--save={tmp_path}", "--eval_iters=0")
    assert "resuming from" in resumed and sorted(log_fields(resumed)) == [last + 1]


# -- 3. configs that do not lie ----------------------------------------------------------------------------------


def test_only_the_tiny_default_trains_on_the_bundled_corpus(tmp_path):
    gpt2 = os.path.join(ROOT, "config/gpt2_125m.py")
    with pytest.raises(ValueError, match="config/gpt2_125m.py sets no data_path"):
        arguments.validate(arguments.load_config([gpt2]))
    arguments.validate(arguments.load_config([gpt2]), reads_data=False)  # bench.py: random tokens
    arguments.validate(arguments.load_config([]))  # config/tiny.py
    proc = subprocess.run(
        [
            sys.executable,
            "tools/show_samples.py",
            "config/tr8b_104b.py",
            "--iterations",
            "13251-13260",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 2
        and "sets no data_path" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_warns_when_the_data_repeats_many_epochs(corpus, capsys):
    cfg = arguments.prepare(arguments.load_config([*SMALL, "--train_iters=1"]))
    context = section(loader.DataContext, cfg)
    loader.check_data(cfg.split, context, [corpus], train_samples=100)
    assert "warning" not in capsys.readouterr().out
    loader.check_data(cfg.split, context, [corpus], train_samples=200_000)
    assert re.search(
        r"warning: this run goes over the train split of .* \d+\.\d times", capsys.readouterr().out
    )


# -- 4. use the model ---------------------------------------------------------------------------------------------


def test_eval_only_prints_validation_and_writes_nothing(ckpt):
    before = _files(ckpt)
    out = run_main(*SMALL, "--train_iters=2", f"--load={ckpt}", f"--save={ckpt}", "--eval_only")
    m = re.search(
        r"validation loss at iteration 2 \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|", out
    )
    assert m and abs(
        float(m.group(2)) - torch.tensor(float(m.group(1))).exp().item()
    ) < 1e-3 * float(m.group(2))
    # no training iteration, nothing written
    assert log_fields(out) == {} and _files(ckpt) == before
    # the sample sample_tokens asks for, as at a training run's end (it printed none, in silence)
    assert " sample " not in out
    out = run_main(*SMALL, "--train_iters=2", f"--load={ckpt}", "--eval_only", "--sample_tokens=8")
    assert "-" * 30 + " sample " + "-" * 30 in out and _files(ckpt) == before


def test_eval_only_reads_the_weights_whatever_the_optimizer_and_lr_keys_say(ckpt):
    """eval_only trains nothing: an LR, Adam settings or a precision other than the checkpoint's run were
    refused (the LR schedule's and the optimizer's resume checks); bf16 evaluates the fp32 weights in bf16."""
    plain = run_main(*SMALL, "--train_iters=2", f"--load={ckpt}", "--eval_only")
    loss = re.compile(r"validation loss at iteration 2 \| lm loss value: (\S+)")
    for changed in (["--lr=1"], ["--adam_beta2=0.99", "--weight_decay=0.2"]):
        out = run_main(*SMALL, "--train_iters=2", f"--load={ckpt}", "--eval_only", *changed)
        assert loss.search(out).group(1) == loss.search(plain).group(1), changed
    out = run_main(*SMALL, "--train_iters=2", f"--load={ckpt}", "--eval_only", "--bf16")
    assert abs(float(loss.search(out).group(1)) / float(loss.search(plain).group(1)) - 1) < 1e-2


def test_eval_only_without_a_checkpoint_is_an_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="eval_only needs a checkpoint"):
        run_main(*SMALL, "--train_iters=2", f"--save={tmp_path}", "--eval_only")


def test_sample_tool_continues_the_prompt(ckpt):
    proc = subprocess.run(
        [
            sys.executable,
            "tools/sample.py",
            "--load",
            str(ckpt),
            "--prompt",
            "ROMEO:",
            "--max_tokens",
            "5",
            "--seed",
            "3",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    tok = data.get_tokenizer()
    assert proc.stdout.startswith("ROMEO:") and len(tok.encode(proc.stdout.rstrip("\n"))) >= 4


def test_sample_prompt_key(ckpt, tmp_path):
    out = run_main(
        *SMALL,
        "--train_iters=3",
        f"--save={_copy(ckpt, tmp_path / 'r')}",
        "--sample_tokens=3",
        "--sample_prompt=JULIET:",
        "--eval_iters=0",
    )
    assert re.search(r"-+ sample -+\nJULIET:", out)


# -- 5. monitoring ------------------------------------------------------------------------------------------------


def test_tensorboard_scalars_against_samples_and_tokens(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_main(*SMALL, "--train_iters=2", f"--tensorboard_dir={tmp_path}", "--eval_iters=0")
    for axis, tag, steps in (
        ("", "lm-loss", [1, 2]),
        ("samples", "lm-loss vs samples", [8, 16]),
        ("tokens", "lm-loss vs tokens", [512, 1024]),
    ):  # each axis in a directory of its own: a resume hides each one's abandoned steps
        events = EventAccumulator(str(tmp_path / axis))
        events.Reload()
        assert [e.step for e in events.Scalars(tag)] == steps
    # without save, metrics.jsonl goes to tensorboard_dir: one object per iteration, every field of the log line
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["iteration"] for r in records] == [1, 2]
    for record, (it, fields) in zip(records, sorted(log_fields(out).items())):
        assert set(fields) <= set(record), set(fields) - set(record)
        assert math.isclose(record["lm loss"], float(fields["lm loss"]), rel_tol=1e-6), it


# -- 8. bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--lr=inf"], "lr=inf is not a finite number"),
        (["--global_batch_size=0"], "global_batch_size=0 must be positive"),
        (["--micro_batch_size=0"], "micro_batch_size=0 must be positive"),
        (["--train_iters=-5"], "train_iters=-5 must be positive"),
        # read as unset: a cosine decay over the whole run
        (
            ["--lr_decay_samples=0"],
            "lr_decay_samples=0 must be positive, or unset for the run's length",
        ),
        # Megatron's 0 is off; here it stopped the run after its first iteration
        (["--exit_interval=0"], "exit_interval=0 must be positive; unset it for no exit"),
        # it wrote into the load directory of a run that "writes nothing"
        (
            ["--eval_only", "--dump_weights"],
            "dump_weights writes the loaded weights into the load directory",
        ),
        (
            ["--exit_duration_in_mins=0"],
            "exit_duration_in_mins=0.0 must be positive; unset it for no exit",
        ),
    ],
)
def test_values_that_cannot_work(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(overrides))


def test_config_file_with_a_syntax_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("num_layers = 2\nlr = = 3\n")
    with pytest.raises(ValueError, match=r"bad.py, line 2: invalid syntax"):
        arguments.load_config([str(bad)])


def test_failing_bitsandbytes_import(corpus, tmp_path, monkeypatch):
    # `import bitsandbytes` now raises ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ValueError, match="use_bnb_optimizer needs bitsandbytes"):
        run_main(*SMALL, "--train_iters=1", "--use_bnb_optimizer", f"--save={tmp_path}")
    assert not os.path.exists(tmp_path / "lock")


def test_save_directory_is_checked_at_start(corpus, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot create the save directory"):
        run_main(*SMALL, "--train_iters=1", f"--save={tmp_path}/file/run")


def test_token_ids_outside_the_vocabulary(tmp_path, monkeypatch):
    """Refused before the model is built: the build came first (minutes on every rank of a large model)."""
    import builders

    def build(*args, **kwargs):
        raise AssertionError("built before the refusal")

    monkeypatch.setattr(builders, "build", build)
    prefix = str(tmp_path / "big")
    data.write_indexed_dataset(prefix, [list(range(1, 200)) + [60000]] * 30)
    with pytest.raises(ValueError, match="token id 60000, at or above vocab_size 50257"):
        run_main(*SMALL, "--train_iters=1", f"--data_path={prefix}", f"--save={tmp_path}/run")
    assert json.load(open(prefix + ".maxid"))["max"] == 60000  # remembered for the next run
    assert not os.path.exists(tmp_path / "run" / "global_step1")
    # a negative id in a signed dtype (padding written as -1): it was an IndexError at its first batch
    data.write_indexed_dataset(prefix + "-pad", [list(range(1, 200)) + [-1]] * 30, dtype=np.int32)
    with pytest.raises(ValueError, match="holds token id -1: no token has a negative id"):
        run_main(*SMALL, "--train_iters=1", f"--data_path={prefix}-pad", f"--save={tmp_path}/run")
    cached = json.load(open(prefix + "-pad.maxid"))
    assert cached["min"] == -1
    del cached[
        "min"
    ]  # a cache written before the smallest id was kept: the corpus is scanned again
    open(prefix + "-pad.maxid", "w").write(json.dumps(cached))
    with pytest.raises(ValueError, match="holds token id -1: no token has a negative id"):
        run_main(*SMALL, "--train_iters=1", f"--data_path={prefix}-pad", f"--save={tmp_path}/run")


def test_disk_full_during_save_cleans_up(corpus, tmp_path, monkeypatch):
    saves = []

    def full_disk(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) > 2:  # the first checkpoint (two files) fits, the second does not
            f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return torch_save(obj, f, *args, **kwargs)

    torch_save = torch.save
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(ValueError, match="no space left on device"):
        run_main(
            *SMALL, "--train_iters=2", "--save_interval=1", f"--save={tmp_path}", "--eval_iters=0"
        )
    assert _latest(tmp_path) == "global_step1"
    # no .partial, no lock; metrics.jsonl and TensorBoard's events are the run's logs, not checkpoint debris
    assert sorted(os.listdir(tmp_path)) == [
        "global_step1",
        "latest",
        "metrics.jsonl",
        "tensorboard",
    ]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "holder, refused",
    [
        ({"host": socket.gethostname(), "pid": os.getpid()}, True),  # a live run on this host
        ({"host": "another-node", "pid": 1}, True),  # cannot tell: refuse
        ({"host": socket.gethostname(), "pid": None}, False),  # stale: a dead process on this host
    ],
)
def test_one_run_per_save_directory(corpus, tmp_path, holder, refused):
    if holder["pid"] is None:
        holder["pid"] = _dead_pid()
    (tmp_path / "lock").write_text(json.dumps({**holder, "since": "2026-01-01 00:00:00"}))
    if refused:
        with pytest.raises(
            ValueError, match=f"in use by another run \\(host {holder['host']} pid {holder['pid']}"
        ):
            run_main(*SMALL, "--train_iters=1", f"--save={tmp_path}")
        assert not os.path.exists(tmp_path / "latest")
    else:
        out = run_main(*SMALL, "--train_iters=1", f"--save={tmp_path}", "--eval_iters=0")
        assert "taking over the lock" in out and _latest(tmp_path) == "global_step1"
        assert not os.path.exists(tmp_path / "lock")  # released at the end


@pytest.mark.parametrize(
    "holder, running, taken",
    [
        (
            {"slurm_job": "111", "slurm_restart": 0},
            False,
            "whose SLURM job 111 is no longer running (squeue)",
        ),
        ({"slurm_job": "111", "slurm_restart": 0}, True, None),
        (
            {"slurm_job": "111", "slurm_restart": 0},
            None,
            None,
        ),  # squeue cannot be asked: cannot tell
        (
            {"slurm_job": "222", "slurm_restart": 0},
            "unasked",
            "an earlier run of this SLURM job (222), requeued",
        ),
        ({"slurm_job": "222", "slurm_restart": 1}, True, None),
        ({}, False, None),  # no job recorded: cannot tell
    ],
)
def test_a_lock_on_another_node_is_taken_over_once_slurm_says_its_job_is_gone(
    tmp_path, monkeypatch, capsys, holder, running, taken
):
    """The SLURM chain resumes on other nodes: after a crash (no clean release) the next job of the array found
    a lock of another host and was refused, and so was each job after it. The lock records the SLURM job;
    squeue says whether it still runs, and an earlier incarnation of a requeued job is gone by SLURM's rule."""
    lock = tmp_path / safety.LOCK
    lock.write_text(json.dumps({"host": "another-node", "pid": 7, "since": "then", **holder}))
    monkeypatch.setenv("SLURM_JOB_ID", "222")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")

    def squeue(job):
        assert running != "unasked", "an earlier incarnation of this job needs no squeue"
        return running

    monkeypatch.setattr(safety, "slurm_job_running", squeue)
    if taken is None:
        with pytest.raises(ValueError, match="in use by another run \\(host another-node pid 7"):
            safety.acquire_lock(str(tmp_path))
        assert json.loads(lock.read_text())["pid"] == 7
        return
    path = safety.acquire_lock(str(tmp_path))
    assert capsys.readouterr().out == f"taking over the lock {path} of pid 7, {taken}\n"
    mine = json.loads(lock.read_text())
    assert (mine["pid"], mine["slurm_job"], mine["slurm_restart"]) == (os.getpid(), "222", 1)
    safety.release_lock(path)


@pytest.mark.parametrize(
    "squeue, running",
    [
        ((0, "RUNNING\n", ""), True),
        ((0, "COMPLETING\n", ""), True),
        ((0, "", ""), False),  # ended, still in slurmctld's memory: not listed
        # or listed with its end state: a time-limit kill, a node failure
        ((0, "TIMEOUT\n", ""), False),
        ((0, "NODE_FAIL\n", ""), False),
        ((1, "", "slurm_load_jobs error: Invalid job id specified\n"), False),
        ((1, "", "slurm_load_jobs error: Unable to contact slurm controller\n"), None),
        (FileNotFoundError(2, "squeue"), None),
    ],
)
def test_what_squeue_says_of_a_job(monkeypatch, squeue, running):
    def run(argv, **kwargs):
        assert argv == ["squeue", "-h", "-j", "111", "-o", "%T"]
        if isinstance(squeue, Exception):
            raise squeue
        return subprocess.CompletedProcess(argv, squeue[0], squeue[1], squeue[2])

    monkeypatch.setattr(safety.subprocess, "run", run)
    assert safety.slurm_job_running("111") is running


def test_two_runs_taking_over_one_stale_lock_do_not_both_hold_it(tmp_path, monkeypatch):
    """Run B finds a dead run's lock; before B removes it, run A (faster) has taken it over and made its own.
    B removed A's fresh lock and made its own: both trained into one save directory."""
    lock = tmp_path / safety.LOCK
    host = socket.gethostname()
    lock.write_text(json.dumps({"host": host, "pid": _dead_pid(), "since": "then"}))
    run_a = {"host": host, "pid": os.getppid(), "since": "now"}  # a live process

    def a_takes_it_meanwhile(pid):
        lock.unlink()
        lock.write_text(json.dumps(run_a))
        monkeypatch.setattr(safety, "alive", lambda pid: pid == run_a["pid"])
        return False

    monkeypatch.setattr(safety, "alive", a_takes_it_meanwhile)
    with pytest.raises(
        ValueError, match=f"in use by another run \\(host {host} pid {run_a['pid']} since now"
    ):
        safety.acquire_lock(str(tmp_path))
    assert json.loads(lock.read_text()) == run_a and sorted(os.listdir(tmp_path)) == [safety.LOCK]


def test_a_run_where_no_checkpoint_is_sets_an_earlier_runs_logs_aside(corpus, tmp_path):
    """A run killed before its first save left metrics.jsonl; the next run appended to it, and a reader (which
    keeps each iteration's last record) saw one run: the new run's iterations 1-2, then the dead one's 3-62."""
    dead = "".join(json.dumps({"iteration": i, "lm loss": 9.0}) + "\n" for i in range(1, 63))
    (tmp_path / "metrics.jsonl").write_text(dead)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.dead").write_text("dead")
    out = run_main(*SMALL, "--train_iters=2", f"--save={tmp_path}", "--eval_iters=0")
    assert (
        f"{tmp_path} holds no checkpoint but the logs of a run before this one: moved metrics.jsonl to "
        "metrics.1.jsonl and tensorboard to tensorboard.1, so that this run's are not read as its continuation"
    ) in out
    assert (tmp_path / "metrics.1.jsonl").read_text() == dead
    assert os.listdir(tmp_path / "tensorboard.1") == ["events.dead"]

    def iterations():
        return [
            (r["iteration"], r.get("timeline"))
            for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        ]

    assert iterations() == [(1, None), (2, None)]
    # a resume continues its own run's file, from its checkpoint's iteration on (report.read_metrics)
    assert "holds no checkpoint" not in run_main(
        *SMALL, "--train_iters=3", f"--save={tmp_path}", "--eval_iters=0"
    )
    assert iterations() == [(1, None), (2, None), (2, "resume"), (3, None)]


def test_a_damaged_stop_record_is_refused_by_name_and_the_lock_released(corpus, tmp_path):
    (tmp_path / "stopped.json").write_text("{not json")
    with pytest.raises(ValueError, match="stopped.json is not a stop record this code wrote"):
        run_main(*SMALL, "--train_iters=1", f"--save={tmp_path}")
    assert not os.path.exists(tmp_path / "lock") and not os.path.exists(tmp_path / "latest")
    assert (tmp_path / "stopped.json").read_text() == "{not json"  # not ours to remove


def test_a_second_stop_at_one_iteration_keeps_the_first_record(tmp_path):
    """The records set aside are "kept, never removed": a second stop at iteration 2 replaced the first's."""
    first = {"iteration": 2, "cause": "the first stop", "next": "read it"}
    (tmp_path / "stopped_at_2.json").write_text(json.dumps(first))
    (tmp_path / "stopped.json").write_text(json.dumps({**first, "cause": "the second stop"}))
    line = safety.set_stopped_aside(str(tmp_path))
    assert line.endswith(f"its record moved to {tmp_path / 'stopped_at_2.1.json'}")
    assert json.loads((tmp_path / "stopped_at_2.json").read_text())["cause"] == "the first stop"
    assert json.loads((tmp_path / "stopped_at_2.1.json").read_text())["cause"] == "the second stop"
    assert not os.path.exists(tmp_path / "stopped.json")


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no text in"),
        ('{"text": "fine"}\nnot json\n', "expected a JSON object"),
    ],
)
def test_data_py_bad_input(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    proc = subprocess.run(
        [
            sys.executable,
            "data.py",
            "--input",
            str(path),
            "--output-prefix",
            str(tmp_path / "out"),
            "--workers",
            "1",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


# -- 9. determinism -----------------------------------------------------------------------------------------------


def test_deterministic_switch(corpus, tmp_path, monkeypatch):
    # recorded, so that teardown removes what the run sets
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    try:
        run_main(*SMALL, "--train_iters=1", "--deterministic", "--eval_iters=0")
        assert torch.are_deterministic_algorithms_enabled()
        assert (
            os.environ["MKL_CBWR"] == "AUTO,STRICT"
            and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        )
    finally:
        torch.use_deterministic_algorithms(False)


# -- 10. every torchrun worker stops at the same iteration ----------------------------------------------------------


def _workers_agree_when_to_exit():
    import types

    import parallel
    import safety

    rank = parallel.grid.rank
    exit_signal = safety.ExitSignal(True)
    try:
        assert exit_signal() is False
        # torchrun forwards SIGTERM to every worker, but they need not get it in the same iteration
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exit_signal() == "SIGTERM", rank
    finally:
        exit_signal.restore()
    # SLURM's early SIGUSR1 to one task: every rank names it, not SIGTERM
    exit_signal = safety.ExitSignal(True)
    try:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert exit_signal() == "SIGUSR1", rank
    finally:
        exit_signal.restore()
    # exit_duration_in_mins runs on rank 0's clock: a worker whose clock says otherwise follows rank 0
    cfg = types.SimpleNamespace(exit_interval=None, exit_duration_in_mins=1.0, save="run")
    now, exit_reason = time.time(), safety.exit_reason
    assert exit_reason(cfg, 1, now - (120 if rank == 1 else 0), lambda: False) is None, rank
    assert exit_reason(cfg, 1, now - (120 if rank == 0 else 0), lambda: False) is not None, rank


def test_exit_duration_counts_from_the_jobs_start_not_from_its_first_iteration(corpus, monkeypatch):
    """The clock started after the build, the checkpoint's load and the data's index (minutes at scale): a job
    with exit_duration_in_mins a few minutes under SLURM's limit overran it and was killed unsaved."""
    import builders

    started, clocks, build = time.time(), [], builders.build

    def timed_build(*args, **kwargs):
        clocks.append(("build", time.time()))
        return build(*args, **kwargs)

    def exit_reason(ckpt_cfg, iterations, job_start, exit_signal):
        clocks.append(("clock", job_start))
        exit_signal()
        return None

    monkeypatch.setattr(builders, "build", timed_build)
    monkeypatch.setattr(safety, "exit_reason", exit_reason)
    run_main(*SMALL, "--train_iters=1", "--exit_duration_in_mins=60")
    (_, built), (_, job_start) = clocks[0], clocks[1]
    assert started <= job_start <= built


def test_sigterm_and_exit_duration_are_agreed_across_workers():
    spawn(_workers_agree_when_to_exit, 2)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_the_documented_slurm_signal_asks_to_save_and_exit(signum, capsys):
    """docs/parallelism.md's recipe sends SIGUSR1 ten minutes ahead (#SBATCH --signal=USR1@600) to every task;
    the time limit's SIGTERM still counts, and the log names the one that came (not "SIGTERM" for a SIGUSR1).
    The previous handlers come back at the end."""
    import safety

    before = {s: signal.getsignal(s) for s in safety.ExitSignal.SIGNALS}
    exit_signal = safety.ExitSignal(True)
    try:
        assert exit_signal() is False
        os.kill(os.getpid(), signum)
        assert exit_signal() == signal.Signals(signum).name
        # asked again (every iteration): said once
        assert exit_signal() == signal.Signals(signum).name
    finally:
        exit_signal.restore()
    assert {s: signal.getsignal(s) for s in safety.ExitSignal.SIGNALS} == before
    said = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("exit_signal_handler:")
    ]
    assert said == [
        f"exit_signal_handler: {signal.Signals(signum).name} received; saving and exiting at the end of "
        "this iteration"
    ]
    with open(os.path.join(ROOT, "docs", "parallelism.md")) as f:
        doc = f.read()
    assert (
        "#SBATCH --signal=USR1@600" in doc
        and "--exit_signal_handler" in doc
        and "--kill-on-bad-exit=1" in doc
    )


def _one_rank_scans_for_the_largest_id(prefix):
    import dataclasses

    import data
    import parallel

    scans = []
    scan = data.token_id_range
    data.token_id_range = lambda indexed: scans.append(indexed.prefix) or scan(indexed)
    try:
        context = loader.DataContext(64, 50257, None, False, 0, 1)
        loader.check_data("969,30,1", context, [prefix], 10)  # in the vocabulary: passes
        context = dataclasses.replace(context, vocab_size=1000)
        with pytest.raises(ValueError, match="holds token id 50256, at or above vocab_size 1000"):
            loader.check_data("969,30,1", context, [prefix], 10)  # every rank: rank 0's number
    finally:
        data.token_id_range = scan
    assert scans == ([prefix] * 2 if parallel.grid.rank == 0 else []), (parallel.grid.rank, scans)


def test_one_rank_scans_the_corpus_for_its_largest_token_id(corpus):
    # DP 2 over gloo: on a first run over a new corpus every rank used to read the whole .bin at once
    spawn(_one_rank_scans_for_the_largest_id, 2, 1, 1, corpus)


def test_the_exit_reason_names_the_signal_that_came():
    """A SLURM recipe's SIGUSR1 is logged as SIGUSR1, not as the SIGTERM it once was said to be."""
    cfg = types.SimpleNamespace(exit_interval=None, exit_duration_in_mins=None, save="run")
    exit_reason = safety.exit_reason
    for name in ("SIGUSR1", "SIGTERM"):
        assert exit_reason(cfg, 1, time.time(), lambda: name) == f"{name} (exit_signal_handler)"
    assert exit_reason(cfg, 1, time.time(), lambda: False) is None
    # with nothing to save to, the exit line says nothing was saved
    unsaved = types.SimpleNamespace(exit_interval=1, exit_duration_in_mins=None, save=None)
    assert exit_reason(unsaved, 1, time.time(), lambda: False) == (
        "exit_interval / exit_duration_in_mins; nothing saved: save is not set"
    )


def test_a_signal_with_no_save_directory_does_not_say_it_saves(capsys):
    """It said "saving and exiting" and exited 0 with nothing on disk."""
    exit_signal = safety.ExitSignal(True, saves=False)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exit_signal() == "SIGUSR1"
    finally:
        exit_signal.restore()
    assert capsys.readouterr().out == (
        "exit_signal_handler: SIGUSR1 received; exiting, with nothing saved (save is not set), at the end of "
        "this iteration\n"
    )


def _megatron_deepspeed_layout(directory):
    (directory / "global_step10").mkdir(parents=True)
    (directory / "latest").write_text("global_step10")
    for name in ("mp_rank_00_model_states.pt", "layer_01-model_00-model_states.pt"):
        (directory / "global_step10" / name).write_bytes(b"")
    return directory


def test_a_load_that_names_no_checkpoint_of_ours_is_refused_with_the_fix(ckpt, tmp_path):
    """Each trained from scratch and exited 0 (a checkpoint's own directory for its parent, an empty directory
    that is not the save directory) or named the wrong fix (Megatron-DeepSpeed's files: "the checkpoint is
    incomplete")."""
    step = ckpt / "global_step2"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{step} is a checkpoint, not a directory of checkpoints: give its directory ({ckpt}), whose 'latest' "
            f"file names the checkpoint to resume (echo global_step2 > {ckpt / 'latest'})"
        ),
    ):
        run_main(*SMALL, "--train_iters=3", f"--load={step}", f"--save={tmp_path / 'new'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=f"load directory {empty} holds no checkpoint \\(no 'latest' file\\)"
    ):
        run_main(*SMALL, "--train_iters=3", f"--load={empty}", f"--save={tmp_path / 'new'}")
    mds = _megatron_deepspeed_layout(tmp_path / "mds")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "was written by Megatron-DeepSpeed (layer_*-model_*-model_states.pt): import it first, python "
            f"tools/import_megatron_deepspeed.py --load {mds} --save DIR, then --load DIR"
        ),
    ):
        run_main(*SMALL, "--train_iters=3", f"--load={mds}", f"--save={tmp_path / 'new'}")
    assert not os.path.exists(tmp_path / "new" / "latest")
    # the first job of the SLURM habit (load = save, nothing there yet) trains from scratch, as before
    first = tmp_path / "first"
    assert "training from scratch" in run_main(
        *SMALL, "--train_iters=1", f"--load={first}", f"--save={first}"
    )
