"""Every lever of the chronicles, through the trainer: each test fails if the switch does something else."""

import math
import os
import re

import numpy as np
import pytest
import torch

import arguments
import data
import optim
import schedule
import training
from builders import build_model, build_optimizer, step_rules
from helpers import (  # noqa: F401 (fixtures)
    SMALL,
    assert_same_checkpoint,
    corpus,
    corpus512,
    data_of,
    log_fields,
    losses,
    plan_of,
    run_cli,
    run_main,
)
from training import whole_step

NO_DROPOUT = ["--hidden_dropout=0", "--attention_dropout=0"]


@pytest.fixture
def small512(corpus512):
    """SMALL on a 512-token vocabulary, for the runs whose subject is not the vocabulary (the schedules, exits,
    skips, resumes and optimizer levers below): the GPT-2 vocabulary's output layer was most of their time, and
    each still fails if its switch does something else. On CPU, fp16 and bf16 matmuls are emulated: there it is
    8x the run's time. The runs whose subject is the vocabulary (its padding, split across TP) keep it:
    test_parallel, test_precision, test_topology."""
    return [*SMALL, f"--data_path={corpus512}", "--vocab_size=512"]


@pytest.fixture
def half(small512):
    """The loss scaler's and the master weights' runs (small512)."""
    return small512


def checkpoint_state(directory, iteration):
    tag = os.path.join(directory, f"global_step{iteration}")
    model = torch.load(os.path.join(tag, "mp_rank_00_000_model_states.pt"), weights_only=False)
    rank = torch.load(os.path.join(tag, "rank_00000_optim_states.pt"), weights_only=False)
    return model["model"], rank["optimizer"], model["run"]


def steps_of(optimizer_state):
    return {int(s["step"]) for s in optimizer_state["state"].values()}


# -- precision and skipped steps -------------------------------------------------------------------------------


def test_fp16_dynamic_loss_scale_overflows_skip_and_halve(half, tmp_path):
    # 2^24: the first iterations' fp16 gradients overflow (2^20 overflowed at once only while the micro-batches
    # were summed in fp16; in fp32 it overflows at iterations 2 and 6)
    out = run_main(
        *half,
        "--fp16",
        "--train_iters=8",
        "--initial_loss_scale=16777216",
        "--hysteresis=2",
        f"--save={tmp_path}",
    )
    overflows = re.findall(
        r"OVERFLOW! Skipping step. Attempted loss scale: (\S+), reducing to (\S+)", out
    )
    assert overflows, out
    # hysteresis 2: the first overflow keeps the scale, the next ones halve it (lesson 5)
    assert overflows[0] == ("16777216.0", "16777216.0")
    assert overflows[1] == ("16777216.0", "8388608.0")
    fields = log_fields(out)
    assert fields[1]["number of skipped iterations"] == "1"
    assert fields[1]["loss scale"] == "16777216.0" and fields[2]["loss scale"] == "8388608.0"
    # it does get to train
    assert any(f["number of skipped iterations"] == "0" for f in fields.values())
    # a skipped step changes nothing: the optimizer has stepped once per applied iteration only
    _, opt, run = checkpoint_state(tmp_path, 8)
    applied = sum(f["number of skipped iterations"] == "0" for f in fields.values())
    assert steps_of(opt) == {applied}
    # the scaler state is checkpointed
    assert run["scaler"]["scale"] == float(fields[8]["loss scale"]) < 2**24


@pytest.mark.parametrize(
    "precision",
    [["--fp16", "--initial_loss_scale=65536", "--loss_scale_window=2"], ["--bf16"]],
    ids=["fp16", "bf16"],
)
def test_half_precision_resume_is_bit_exact_including_the_loss_scaler(half, tmp_path, precision):
    args = [*half, *precision]
    full = losses(run_main(*args, "--train_iters=8", f"--save={tmp_path / 'a'}"))
    run_main(*args, "--train_iters=4", f"--save={tmp_path / 'b'}")
    resumed = losses(
        run_main(*args, "--train_iters=8", f"--save={tmp_path / 'b'}", f"--load={tmp_path / 'b'}")
    )
    assert {i: full[i] for i in range(5, 9)} == resumed
    # half weights, fp32 masters, moments, step, loss scaler and its hysteresis, RNG: bit for bit
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b", 8)
    # the checkpoint holds the half-precision model and the fp32 master weights it was rounded from
    model, opt, _ = checkpoint_state(tmp_path / "b", 4)
    half_dtype = torch.float16 if "--fp16" in precision else torch.bfloat16
    assert {v.dtype for v in model.values()} == {half_dtype}
    masters = opt["fp32_master_weights"]
    assert {m.dtype for m in masters} == {torch.float32} and len(masters) == len(model)


def test_bf16_trains_past_the_warmup_like_fp32(half, tmp_path):
    """12 iterations, 7 of them past the 5-iteration warm-up: the bf16 loss falls as fp32's does (within 0.1%; the
    gap measured at most 7e-5 of the loss here, 512 tokens), and every bf16 weight moved and is its fp32 master
    rounded."""
    args = [*half, *NO_DROPOUT, "--train_iters=12", "--lr=5e-3"]
    fp32 = {i: float(v) for i, v in losses(run_main(*args)).items()}
    bf16 = {i: float(v) for i, v in losses(run_main(*args, "--bf16", f"--save={tmp_path}")).items()}
    assert fp32 != bf16  # bf16 really computes in bf16
    assert sorted(bf16) == list(range(1, 13))
    for i in bf16:
        assert math.isclose(fp32[i], bf16[i], rel_tol=1e-3), (i, fp32[i], bf16[i])
    # it learns once past the warm-up
    assert bf16[12] < min(bf16[i] for i in range(1, 7)) - 0.4, bf16
    weights, opt, _ = checkpoint_state(tmp_path, 12)
    cfg = arguments.prepare(arguments.load_config([*args, "--bf16"]))
    initial = build_model(cfg, torch.device("cpu")).state_dict()
    assert set(weights) == set(initial) and {w.dtype for w in weights.values()} == {torch.bfloat16}
    moved = [k for k in weights if not torch.equal(weights[k], initial[k])]
    assert moved == list(weights), set(weights) - set(moved)
    # in the optimizer's order, not by name
    rounded = [m.to(torch.bfloat16) for m in opt["fp32_master_weights"]]
    assert all(
        any(torch.equal(w, r) for r in rounded if r.shape == w.shape) for w in weights.values()
    )


def test_static_loss_scale_is_used_and_kept(half):
    out = run_main(*half, "--fp16", "--loss_scale=128", "--train_iters=2")
    assert all(f["loss scale"] == "128.0" for f in log_fields(out).values())


def test_skip_grad_norm_above_skips_without_updating(small512, tmp_path):
    out = run_main(
        *small512, "--train_iters=3", "--skip_grad_norm_above=1e-6", f"--save={tmp_path}"
    )
    fields = log_fields(out)
    assert all(f["number of skipped iterations"] == "1" for f in fields.values())
    model_state, opt, _ = checkpoint_state(tmp_path, 3)
    assert opt["state"] == {}  # never stepped
    fresh = build_model(
        arguments.prepare(arguments.load_config(list(small512))), torch.device("cpu")
    )
    assert all(torch.equal(v, model_state[k]) for k, v in fresh.state_dict().items())


def test_nan_loss_never_updates_the_weights():
    cfg = arguments.prepare(arguments.load_config([*SMALL, *NO_DROPOUT, "--train_iters=1"]))
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    with torch.no_grad():
        model.ln_f.bias[0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 50257, (4, 64))
    step = whole_step(
        model,
        optimizer,
        optim.scaler_for(cfg),
        [(x, x), (x, x)],
        1e-3,
        step_rules(cfg),
        torch.device("cpu"),
    )
    assert step.outcome == "nan" and math.isnan(step.loss)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k != "ln_f.bias")
    assert optimizer.state_dict()["state"] == {}


def test_bnb_8bit_adam_runs_and_resumes_exactly(small512, tmp_path):
    args = [*small512, "--use_bnb_optimizer"]
    full = losses(run_main(*args, "--train_iters=6", f"--save={tmp_path / 'a'}"))
    assert float(full[6]) < float(full[1])
    run_main(*args, "--train_iters=3", f"--save={tmp_path / 'b'}")
    resumed = losses(
        run_main(*args, "--train_iters=6", f"--save={tmp_path / 'b'}", f"--load={tmp_path / 'b'}")
    )
    assert {i: full[i] for i in (4, 5, 6)} == resumed
    # the 8-bit states and their statistics too
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b", 6)


# -- schedules -----------------------------------------------------------------------------------------------------


def test_batch_size_rampup_follows_megatron(small512):
    out = run_main(
        *small512,
        "--micro_batch_size=4",
        "--global_batch_size=12",
        "--rampup_batch_size",
        "4",
        "4",
        "40",
        "--train_samples=120",
        "--train_iters=none",
    )
    fields = log_fields(out)
    ramp = schedule.RampupBatchSize([4, 4, 40], 12, 4, 1)
    consumed = 0
    for i in sorted(fields):
        expected = ramp(consumed)
        assert int(fields[i]["global batch size"]) == expected
        consumed += expected
        assert int(fields[i]["consumed samples"]) == consumed
    assert {int(f["global batch size"]) for f in fields.values()} == {4, 8, 12}
    # Megatron's update_train_iters: 8 ramp-up iterations reach 44 samples, then (120 - 44) // 12 = 6 full batches;
    # a last batch that would pass train_samples is not run
    assert len(fields) == 14 and consumed == 116


def test_train_tokens_ends_training(small512):
    # 512 tokens per iteration
    out = run_main(*small512, "--train_iters=none", "--train_tokens=1500")
    assert sorted(log_fields(out)) == [1, 2, 3]


def test_curriculum_truncates_counts_tokens_and_evaluates_at_full_length(
    small512, tmp_path, monkeypatch
):
    args = [
        *small512,
        "--curriculum_learning",
        "--min_difficulty=16",
        "--total_curriculum_step=8",
        "--train_iters=10",
        "--eval_interval=5",
    ]
    # the sequence lengths of the evaluation's batches, of training's
    seqlens = {True: set(), False: set()}
    forward_backward = training.forward_backward

    def recording(model, batches, *args, **kw):
        seqlens[kw.get("forward_only", False)].update(x.shape[1] for x, _ in batches)
        return forward_backward(model, batches, *args, **kw)

    monkeypatch.setattr(training, "forward_backward", recording)
    out = run_main(*args, f"--save={tmp_path / 'straight'}")
    monkeypatch.undo()
    fields = log_fields(out)
    tokens = 0
    for i in range(1, 11):
        seqlen = schedule.curriculum_seqlen(i, 16, 64, 8, 8)
        assert int(fields[i]["curriculum seqlen"]) == seqlen
        tokens += 8 * seqlen
        assert int(fields[i]["consumed tokens"]) == tokens
    assert fields[1]["curriculum seqlen"] == "16" and fields[10]["curriculum seqlen"] == "64"
    # evaluation (at iterations 5 and 10, when training's batches are 40 and 64 long) is at the full length
    assert "validation loss at iteration 5" in out
    assert seqlens[True] == {64} and seqlens[False] == {
        schedule.curriculum_seqlen(i, 16, 64, 8, 8) for i in range(1, 11)
    }
    # resuming mid-curriculum continues the same lengths and losses, and ends in the same state
    run_main(*args, "--train_iters=4", f"--save={tmp_path}")
    resumed = run_main(*args, f"--save={tmp_path}", f"--load={tmp_path}")
    assert losses(resumed) == {i: losses(out)[i] for i in range(5, 11)}
    assert_same_checkpoint(tmp_path / "straight", tmp_path, 10)


def test_lr_warmup_and_decay_tokens(small512):
    out = run_main(
        *small512,
        "--train_iters=6",
        "--lr_warmup_samples=0",
        "--lr_warmup_tokens=1024",
        "--lr_decay_samples=none",  # SMALL's: the decay counts tokens here
        "--lr_decay_tokens=4096",
        "--lr_decay_style=linear",
        "--lr=1e-3",
        "--min_lr=1e-4",
    )
    lrs = [float(f["learning rate"]) for _, f in sorted(log_fields(out).items())]
    # tokens before each iteration: 0, 512, 1024, ...; warm-up over 1024 tokens, then linear to 4096
    expected = [
        0.0,
        5e-4,
        1e-3,
        1e-4 + 0.9e-3 * (1 - 512 / 3072),
        1e-4 + 0.9e-3 * (1 - 1024 / 3072),
        1e-4 + 0.9e-3 * (1 - 1536 / 3072),
    ]
    assert lrs == pytest.approx(expected, rel=1e-3, abs=1e-9)


def test_exit_interval_saves_and_resume_continues(small512, tmp_path):
    """exit_interval is Megatron's: the job stops at the run's iterations that are its multiples. It counted this
    job's iterations: a chain resumed at 3 with exit_interval=2 stopped at 5, where a Megatron user expects 4."""
    full = losses(run_main(*small512, "--train_iters=6", f"--save={tmp_path / 'straight'}"))
    out = run_main(*small512, "--train_iters=6", "--exit_interval=3", f"--save={tmp_path}")
    assert sorted(losses(out)) == [1, 2, 3] and "exiting at iteration 3" in out
    assert open(tmp_path / "latest").read().strip() == "global_step3"
    again = run_main(*small512, "--train_iters=6", "--exit_interval=2", f"--save={tmp_path}")
    assert sorted(losses(again)) == [4] and "exiting at iteration 4" in again
    resumed = run_main(*small512, "--train_iters=6", f"--save={tmp_path}", f"--load={tmp_path}")
    assert losses(resumed) == {i: full[i] for i in range(5, 7)}
    assert_same_checkpoint(tmp_path / "straight", tmp_path, 6)


def test_exit_duration_in_mins_saves_and_exits(corpus, tmp_path):
    out = run_main(*SMALL, "--train_iters=50", "--exit_duration_in_mins=1e-9", f"--save={tmp_path}")
    assert sorted(losses(out)) == [1] and os.path.exists(tmp_path / "global_step1")


# -- data skipping -----------------------------------------------------------------------------------------------


def test_skipped_iterations_consume_their_batches_without_training(small512, tmp_path):
    # lr = 0: the weights never move, so a loss depends on the batch only and shows which data an iteration saw
    frozen = [*small512, *NO_DROPOUT, "--lr=0", "--min_lr=0", "--train_iters=8"]
    plain = run_main(*frozen)
    skipping = run_main(*frozen, "--skip-train-iteration-range", "3-4", "7-7")
    plain_f, skip_f = log_fields(plain), log_fields(skipping)
    for i in (3, 4, 7):
        assert "lm loss" not in skip_f[i]
        assert re.search(rf" iteration {i:8d}/.* skipped \(skip_train_iteration_range\)", skipping)
    for i in (1, 2, 5, 6, 8):
        assert skip_f[i]["lm loss"] == plain_f[i]["lm loss"]  # the same batch as the unskipped run
        assert skip_f[i]["consumed samples"] == plain_f[i]["consumed samples"]


def test_every_skip_range_is_honoured_after_a_resume(small512, tmp_path):
    ranges = ["--skip_train_iteration_range", "2-2", "5-6"]
    run_main(*small512, *ranges, "--train_iters=3", f"--save={tmp_path}")
    resumed = run_main(
        *small512, *ranges, "--train_iters=8", f"--save={tmp_path}", f"--load={tmp_path}"
    )
    assert sorted(losses(resumed)) == [4, 7, 8]  # Megatron-DeepSpeed #230 kept only the last range


def test_show_samples_tool_prints_what_an_iteration_consumed(corpus):
    import subprocess
    import sys

    from helpers import ROOT

    proc = subprocess.run(
        [
            sys.executable,
            "tools/show_samples.py",
            "--iterations",
            "2-2",
            *SMALL,
            "--train_iters=4",
            "--max_chars=100000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "=== iteration 2: samples 8-15, seqlen 64" in proc.stdout
    cfg = arguments.prepare(arguments.load_config([*SMALL, "--train_iters=4"]))
    train_data, _ = data_of(cfg, plan_of(cfg))
    text = data.get_tokenizer().decode(train_data[8].tolist())
    assert text in proc.stdout


def test_show_samples_follows_the_run_s_log_past_a_resume_that_changed_the_batch(tmp_path, capsys):
    """The config replayed from iteration 0 named samples 16-23 for iteration 3 of a run whose first two
    iterations took 16 samples each (resumed with 8): 32-39. From the run's log (metrics.jsonl in save), each
    iteration it logged is the run's own; a batch of these keys' that the log contradicts is said."""
    import sys

    from helpers import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_samples

    args = [*SMALL, "--train_iters=4", f"--save={tmp_path}"]
    run_main(*args, "--global_batch_size=16", "--exit_interval=2")
    run_main(*args, "--global_batch_size=8")
    capsys.readouterr()
    show_samples.main(["--iterations", "1-4", "--max_chars=100000", *args, "--global_batch_size=8"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("===")] == [
        "=== iteration 1: samples 0-15, seqlen 64 (the run's batch, from its log; these keys' is 8)",
        "=== iteration 2: samples 16-31, seqlen 64 (the run's batch, from its log; these keys' is 8)",
        "=== iteration 3: samples 32-39, seqlen 64",
        "=== iteration 4: samples 40-47, seqlen 64",
    ]
    cfg = arguments.prepare(arguments.load_config([*SMALL, "--train_iters=6"]))
    train_data, _ = data_of(cfg, plan_of(cfg))
    assert data.get_tokenizer().decode(train_data[39].tolist()) in out.split("=== iteration 4")[0]


def test_show_samples_takes_an_unset_global_batch_from_the_run_s_checkpoint(
    corpus, tmp_path, capsys
):
    """A config that leaves global_batch_size to the layout (micro_batch_size x DP) was replayed as one
    replica's, in silence: for a DP=4 run, iteration 2 was named samples 4-7, not the run's 16-31.
    The run's batch is in its checkpoint; without one the replay says what it assumed."""
    import sys

    from helpers import ROOT, write_checkpoint

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_samples

    run = tmp_path / "run"
    write_checkpoint(str(run), [*SMALL, "--global_batch_size=16"], lambda s: 0)
    unset = [*SMALL, "--global_batch_size=none", "--train_iters=4"]
    capsys.readouterr()
    show_samples.main(["--iterations", "2-2", "--max_chars=0", *unset, f"--save={run}"])
    out = capsys.readouterr().out
    assert "global_batch_size unset: the run's, 16, from its checkpoint " in out
    assert "=== iteration 2: samples 16-31, seqlen 64" in out
    show_samples.main(["--iterations", "2-2", "--max_chars=0", *unset])
    out = capsys.readouterr().out
    assert (
        "replayed as one data-parallel replica's, micro_batch_size 4; give --global_batch_size"
        in out
    )
    assert "=== iteration 2: samples 4-7, seqlen 64" in out


def test_show_samples_says_where_a_run_trained_at_another_seq_length(tmp_path, capsys):
    """Samples of another length are another sample index: after a context extended on resume, the iterations
    before it are named with the length to replay them at, from the log's token counts."""
    import sys

    from helpers import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_samples

    args = [*SMALL, "--position_embedding_type=rotary", "--train_iters=3", f"--save={tmp_path}"]
    run_main(*args, "--seq_length=32", "--exit_interval=2")
    run_main(*args)
    capsys.readouterr()
    show_samples.main(["--iterations", "1-3", "--max_chars=10", *args])
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("===")]
    assert heads == [
        f"=== iteration {i}: samples {8 * i - 8}-{8 * i - 1}, seqlen 64 -- the run trained at seqlen 32 here "
        "(its log): give --seq_length=32 for its samples"
        for i in (1, 2)
    ] + ["=== iteration 3: samples 16-23, seqlen 64"]


def test_show_samples_prints_the_samples_of_a_run_with_a_skip_list(corpus, tmp_path, capsys):
    """A run with skip_documents trains on a sample index built without the listed documents; show_samples built
    it with them, and printed for iteration 1 the text of the very documents the run never read."""
    import json
    import sys

    from helpers import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_samples

    args = [*SMALL, "--train_iters=4", f"--save={tmp_path / 'run'}"]
    cfg = arguments.prepare(arguments.load_config(args))
    plain, _ = data_of(cfg, plan_of(cfg))
    # the documents of iteration 1's samples without the list
    listed = sorted({d for i in range(8) for d, _, _ in plain.provenance(i).pieces})
    skip = tmp_path / "skip_documents.jsonl"
    skip.write_text(json.dumps({"dataset": corpus, "documents": listed}) + "\n")
    trained, _ = data_of(cfg, plan_of(cfg), lambda collections: [np.array(listed)])
    capsys.readouterr()
    show_samples.main(
        ["--iterations", "1-1", "--max_chars=100000", *args, f"--skip_documents={skip}"]
    )
    out = capsys.readouterr().out
    tok = data.get_tokenizer()
    for i in range(8):
        assert tok.decode(trained[i].tolist()) in out, i
        assert tok.decode(plain[i].tolist()) not in out, i


def test_show_samples_names_its_own_flag_in_a_bad_range():
    import sys

    from helpers import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_samples

    with pytest.raises(ValueError) as refused:
        show_samples.main(["--iterations", "1", *SMALL])
    assert str(refused.value).startswith("--iterations entry '1' is not 'START-END'"), refused.value
    assert "skip_train_iteration_range" not in str(refused.value)


# -- optimizer reset ----------------------------------------------------------------------------------------------


def test_reset_optimizer_with_lr0_warmup(small512, tmp_path):
    base = [*small512, "--adam_beta2=0.95", "--save_interval=3", f"--save={tmp_path}"]
    run_main(*base, "--train_iters=3")
    out = run_main(
        *base, "--train_iters=9", f"--load={tmp_path}", "--reset_optimizer_warmup_iters=3"
    )
    assert "optimizer reset at iteration 3" in out
    fields = log_fields(out)
    assert [fields[i]["learning rate"] for i in (4, 5, 6)] == ["0.000E+00"] * 3
    before, _, _ = checkpoint_state(tmp_path, 3)
    after, opt, _ = checkpoint_state(tmp_path, 6)
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr=0: weights bit-identical
    assert steps_of(opt) == {3}  # fresh optimizer: its step counter restarted at 0
    assert any(s["exp_avg_sq"].abs().sum() > 0 for s in opt["state"].values())  # moments warmed up
    # then the normal schedule, no jump: iteration 7 has the lr a plain resume has at the same consumed samples
    plain = run_main(*small512, "--adam_beta2=0.95", "--train_iters=9")
    assert fields[7]["learning rate"] == log_fields(plain)[7]["learning rate"] != "0.000E+00"
    # resuming the reset run again (from its iteration-6 checkpoint) does not reset again
    (tmp_path / "latest").write_text("global_step6\n")
    again = run_main(
        *base, "--train_iters=9", f"--load={tmp_path}", "--reset_optimizer_warmup_iters=3"
    )
    assert "ignored" in again and losses(again) == {i: losses(out)[i] for i in (7, 8, 9)}
    # "auto": AdamW's entry's count, 5 / (1 - adam_beta2)
    assert optim.reset_warmup_iters(optim.OptimizerConfig(adam_beta2=0.95), "auto") == 100


def test_the_lr0_warm_up_counts_applied_updates_not_skipped_iterations(small512, tmp_path):
    """The lesson-9 and lesson-8 recipe together (skip the bad data, reset the optimizer): the window was counted
    in iterations, so a skip range over it used it up on discarded batches and the fresh moments met the full LR
    at their first update. Now: 3 applied updates at lr=0 after the skips."""
    base = [*small512, "--adam_beta2=0.95", f"--save={tmp_path}"]
    run_main(*base, "--train_iters=2")
    out = run_main(
        *base,
        "--train_iters=9",
        f"--load={tmp_path}",
        "--reset_optimizer_warmup_iters=3",
        "--skip_train_iteration_range=3-5",
    )
    fields = log_fields(out)
    assert sorted(fields) == [3, 4, 5, 6, 7, 8, 9] and "learning rate" not in fields[3]
    assert [fields[i]["learning rate"] for i in (6, 7, 8)] == ["0.000E+00"] * 3
    assert fields[9]["learning rate"] != "0.000E+00"
    # the window's count is in the checkpoint: a resume inside it goes on where it stood
    state = torch.load(
        tmp_path / "global_step9" / "mp_rank_00_000_model_states.pt", weights_only=False
    )
    assert state["run"]["state"]["optimizer_reset"] == {
        "iteration": 2,
        "warmup_iters": 3,
        "updates": 3,
    }


def test_no_load_optim_and_no_load_rng(small512, tmp_path):
    run_main(*small512, "--train_iters=3", f"--save={tmp_path}")
    full = losses(run_main(*small512, "--train_iters=5"))
    out = run_main(*small512, "--train_iters=5", f"--load={tmp_path}", "--no_load_rng")
    fresh_rng = losses(out)
    assert fresh_rng[4] != full[4]  # dropout masks come from a different RNG state
    # said, and not the seed's own streams: those would repeat the run's first dropout masks
    seed = arguments.load_config(list(small512)).seed + 3
    assert (
        f"RNG states not restored (no_load_rng): fresh streams seeded with seed + iteration = {seed}"
        in out
    )
    run_main(
        *small512,
        "--train_iters=4",
        f"--load={tmp_path}",
        f"--save={tmp_path / 'x'}",
        "--no_load_optim",
    )
    _, opt, _ = checkpoint_state(tmp_path / "x", 4)
    assert steps_of(opt) == {1}  # not 4: the optimizer started fresh


def test_rng_streams_of_another_device_are_reseeded_not_a_crash():
    """A checkpoint saved on a CPU and resumed on a GPU (or the reverse) holds no model-parallel stream
    for this device (rng.py keeps one per device type): restored as is, the first TP-split dropout
    would stop on a KeyError. Fresh streams instead, and said why."""
    import run_state

    cfg = arguments.load_config([])
    saved = {"model_parallel": {"cpu": torch.get_rng_state()}}
    why = run_state.rng_not_restored(cfg, saved, torch.device("cuda", 0))
    assert why == "saved on cpu, now on cuda"
    assert run_state.rng_not_restored(cfg, saved, "cpu") is None
    assert run_state.rng_not_restored(cfg, {"model_parallel": None}, "cuda") is None  # not seeded
    assert run_state.rng_not_restored(cfg, None, "cpu") == "the layout changed"
