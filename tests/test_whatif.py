"""tools/whatif.py's forks that need the run's help: Adam's beta2 changed on resume (override_adam_params) and
metaseq's soft skip (soft_skip_loss_ratio, in train_step)."""

import json
import os
import re
import shutil
import sys

import pytest
import torch

import arguments
import checkpoint
from helpers import (  # noqa: F401 (synthetic_corpus is a fixture)
    ROOT,
    log_fields,
    run_main,
    synthetic_corpus,
    tool_cli,
    write_checkpoint,
)
from training import Step, whole_step

sys.path.insert(0, os.path.join(ROOT, "tools"))
import optim
import whatif  # noqa: E402
from builders import build_model, build_optimizer, step_rules
from run_state import RunState
from stability.soft_skip import SoftSkip, soft_skip_trend


def trend_of(cfg, history):
    """soft_skip_trend with cfg's soft_skip_loss_ratio and the guard's line (spike_guard_min_steps, _window)."""
    return soft_skip_trend(
        cfg.soft_skip_loss_ratio, history, cfg.spike_guard_min_steps, cfg.spike_guard_window
    )


TINY = [
    "--num_layers=1",
    "--hidden_size=32",
    "--num_attention_heads=2",
    "--seq_length=16",
    "--vocab_size=512",
    "--micro_batch_size=2",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--clip_grad=0",
]


def six_iterations(corpus):
    """TINY for 6 iterations of 4 samples of corpus, logged every one, no validation and no sample."""
    return [
        *TINY,
        "--micro_batch_size=4",
        "--global_batch_size=4",
        "--log_interval=1",
        "--eval_iters=0",
        "--sample_tokens=0",
        f"--data_path={corpus}",
        "--split=100,0,0",
        "--train_iters=6",
    ]


def setup(*extra):
    """A tiny model, our Adam and a batch: the same weights on every call (the seed)."""
    cfg = arguments.prepare(arguments.load_config([*TINY, *extra]))
    model = build_model(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 512, (2, 16), generator=gen),
            torch.randint(0, 512, (2, 16), generator=gen),
        )
    ]
    return cfg, model, build_optimizer(cfg, model), optim.scaler_for(cfg), batches


def step(parts, trend=None, lr=1e-2):
    cfg, model, optimizer, scaler, batches = parts
    return whole_step(
        model,
        optimizer,
        scaler,
        batches,
        lr,
        step_rules(cfg),
        torch.device("cpu"),
        callbacks=SoftSkip(
            cfg, None, cfg.spike_guard_min_steps, cfg.spike_guard_window, trend=trend
        ),
    )


def test_the_soft_skip_scales_the_gradients_of_a_step_above_its_trend_and_leaves_others_alone(
    capsys,
):
    plain, soft, calm = (
        setup(),
        setup("--soft_skip_loss_ratio=1.5"),
        setup("--soft_skip_loss_ratio=1.5"),
    )
    first = step(plain)
    assert step(soft, trend=first.loss / 4).outcome == "ok"  # 4x its trend: gradients x 1/4
    # 1.2x its trend, under the ratio: the plain step, bit for bit
    step(calm, trend=first.loss / 1.2)
    lines = re.findall(
        r"soft skip: loss \S+ is (\S+)x its trend's \S+: gradients x (\S+)", capsys.readouterr().out
    )
    assert lines == [("4.00", "0.25")]
    moments = [
        (plain[2].state[p], soft[2].state[q], calm[2].state[r])
        for p, q, r in zip(
            plain[2].param_groups[0]["params"],
            soft[2].param_groups[0]["params"],
            calm[2].param_groups[0]["params"],
        )
    ]
    for a, b, c in moments:  # Adam's moments saw a quarter of the gradient
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"] / 4, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"] / 16, rtol=1e-5, atol=1e-20)
        assert torch.equal(c["exp_avg"], a["exp_avg"]) and torch.equal(
            c["exp_avg_sq"], a["exp_avg_sq"]
        )
    # Adam's update is blind to a gradient scaled on every step; after an ordinary step, the soft-skipped one enters
    # the moments at a quarter (m = beta1 m + (1 - beta1) g / 4) and moves the weights less than the full step
    full, shrunk = setup(), setup("--soft_skip_loss_ratio=1.5")
    step(full), step(shrunk)
    before = [{k: v.clone() for k, v in parts[1].state_dict().items()} for parts in (full, shrunk)]
    m1 = [full[2].state[p]["exp_avg"].clone() for p in full[2].param_groups[0]["params"]]
    spike = step(full)
    step(shrunk, trend=spike.loss / 4)
    for m, p, q in zip(m1, full[2].param_groups[0]["params"], shrunk[2].param_groups[0]["params"]):
        torch.testing.assert_close(
            shrunk[2].state[q]["exp_avg"] - 0.9 * m,
            (full[2].state[p]["exp_avg"] - 0.9 * m) / 4,
            rtol=1e-4,
            atol=1e-9,
        )
    moved = [
        sum(float((parts[1].state_dict()[k] - w[k]).norm()) for k in w)
        for parts, w in zip((full, shrunk), before)
    ]
    assert moved[1] < moved[0], moved


def test_a_resume_refuses_another_beta2_unless_override_adam_params(synthetic_corpus, tmp_path):
    base = [*six_iterations(synthetic_corpus), "--save_interval=none"]
    save = str(tmp_path / "run")
    run_main(*base, f"--save={save}", "--exit_interval=3")
    with pytest.raises(
        ValueError,
        match=r"other Adam settings than this config \(adam_beta2 0.95 -> 0.99\): a "
        r"resumed optimizer keeps its checkpoint's; set override_adam_params",
    ):
        run_main(*base, f"--save={save}", "--adam_beta2=0.99")  # config/tiny.py's is 0.95
    assert checkpoint.latest_dir(save).endswith("global_step3")  # nothing written
    out = run_main(*base, f"--save={save}", "--adam_beta2=0.99", "--override_adam_params")
    assert (
        "override_adam_params: adam_beta2 0.95 -> 0.99 from now on (the optimizer's moments kept)"
        in out
    )
    _, run, rank = checkpoint.load(checkpoint.latest_dir(save))
    assert run["state"]["iteration"] == 6
    assert all(g["betas"] == (0.9, 0.99) for g in rank["optimizer"]["param_groups"])


def test_a_resume_refuses_another_weight_decay_unless_override_adam_params(
    synthetic_corpus, tmp_path
):
    """The param groups hold the decay coefficient too: a changed weight_decay was printed among the changed
    keys and trained with the checkpoint's (on the same layout; a reshard's groups took the new one)."""
    base = [*six_iterations(synthetic_corpus), "--save_interval=none", "--weight_decay=0.1"]
    save = str(tmp_path / "run")
    run_main(*base, f"--save={save}", "--exit_interval=3")
    for change, what in [
        (["--weight_decay=0.5"], "weight_decay 0.1 -> 0.5"),
        (["--weight_decay_independent"], "weight_decay_independent False -> True"),
    ]:
        with pytest.raises(
            ValueError, match=re.escape(f"other Adam settings than this config ({what})")
        ):
            run_main(*base, f"--save={save}", *change)
    # lr under coupled decay is the schedule's business (override_lr_scheduler), not the groups'
    other_lr = shutil.copytree(save, tmp_path / "lr")
    out = run_main(*base, f"--save={other_lr}", "--lr=0.001", "--override_lr_scheduler")
    assert "override_adam_params" not in out
    out = run_main(*base[:-1], f"--save={save}", "--weight_decay=0.5", "--override_adam_params")
    assert "override_adam_params: weight_decay 0.1 -> 0.5 from now on" in out
    _, run, rank = checkpoint.load(checkpoint.latest_dir(save))
    groups = {g["name"]: g["weight_decay"] for g in rank["optimizer"]["param_groups"]}
    assert run["state"]["iteration"] == 6 and groups == {"decay": 0.5, "no_decay": 0.0}


@pytest.mark.slow
def test_whatif_runs_the_beta2_and_soft_skip_forks_and_the_soft_skip_meets_the_bad_batch(
    synthetic_corpus, tmp_path
):
    """From iteration 20 of a clean run, 4 iterations per fork, a bad batch at 22 in the run's config."""
    base = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=64",
        "--vocab_size=512",
        "--micro_batch_size=8",
        "--global_batch_size=8",
        "--lr=2e-3",
        "--lr_warmup_samples=40",
        "--train_iters=40",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--log_interval=1",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--save_interval=none",
        f"--data_path={synthetic_corpus}",
        "--split=100,0,0",
        "--adam_beta2=0.999",
    ]
    load = str(tmp_path / "base")
    run_main(*base, f"--save={load}", "--exit_interval=20")
    out = str(tmp_path / "whatif")
    results = whatif.main(
        [
            "--load",
            load,
            "--iters=4",
            "--out",
            out,
            "--forks",
            "as is,beta2 0.95,soft skip,z-loss",
            "--",
            *base,
            "--inject_bad_batch_iters=22-22",
        ]
    )
    by_name = {name: series for name, series, _, reached in results if reached}
    # z_loss may change on resume
    assert set(by_name) == {"as is", "beta2 0.95", "soft skip", "z-loss"}
    assert all([it for it, *_ in series] == [21, 22, 23, 24] for series in by_name.values())
    log = open(os.path.join(out, "soft_skip.log")).read()
    assert re.search(r"soft skip: loss \S+ is \S+x its trend's \S+: gradients x 0\.\d+", log), log[
        -2000:
    ]
    # the forks see the same batch at 21 and the same weights: the soft skip changes nothing before the bad batch
    assert by_name["soft skip"][0] == by_name["as is"][0]
    # the bad batch's loss: before its update
    assert by_name["soft skip"][1][1] == by_name["as is"][1][1]
    assert by_name["soft skip"][2][1] != by_name["as is"][2][1]  # after it: a smaller update
    assert (
        "override_adam_params: adam_beta2 0.999 -> 0.95"
        in open(os.path.join(out, "beta2_0.95.log")).read()
    )
    text = open(os.path.join(out, "whatif.txt")).read()
    assert all(re.search(rf"^{name} +\d+ ", text, re.M) for name in by_name), text
    assert os.path.getsize(os.path.join(out, "whatif.png")) > 10_000


def test_the_soft_skip_trend_is_the_guards_line_once_it_has_its_steps_and_never_below_zero():
    cfg = arguments.load_config(["--soft_skip_loss_ratio=1.1", "--spike_guard_min_steps=4"])
    state = RunState()  # the run state keeps the applied steps' numbers, with the guard on or off
    for loss in (6.0, 5.8, 5.6):
        state.advance(8, 16, applied=True, step=Step(loss, 1.0, 0, "ok"))
    assert trend_of(cfg, state.history) is None  # 3 of 4 steps
    state.advance(8, 16, applied=True, step=Step(5.4, 1.0, 0, "ok"))
    assert trend_of(cfg, state.history) == pytest.approx(5.2)
    # off
    assert trend_of(arguments.load_config(["--spike_guard_min_steps=4"]), state.history) is None
    for loss in (4.0, 2.0, 0.5, 0.1):
        state.advance(8, 16, applied=True, step=Step(loss, 1.0, 0, "ok"))
    assert trend_of(cfg, state.history) is None  # the line falls below zero


def _fake_checkpoint(path):
    """A save directory whose `latest` names an empty tag: enough for whatif's checks, and reading it as a
    checkpoint fails (so a check that comes after the read shows as that failure)."""
    os.makedirs(os.path.join(path, "global_step2"))
    with open(os.path.join(path, "latest"), "w") as f:
        f.write("global_step2\n")
    return str(path)


def test_whatif_refuses_an_unknown_run_key_and_an_out_that_is_a_file_before_the_checkpoint_is_read(
    tmp_path,
):
    load = _fake_checkpoint(tmp_path / "run")
    for out, run_args, said in [
        (str(tmp_path / "wi"), ["--no_such_key", "1"], "no_such_key"),
        (str(tmp_path / "afile"), ["--num_layers=1"], "is a file"),
        (load, ["--num_layers=1"], "did not write"),  # a folder of other files
    ]:
        (tmp_path / "afile").write_text("a user's notes\n")
        proc = tool_cli(
            "whatif.py",
            "--load",
            load,
            "--iters=1",
            "--out",
            out,
            "--forks",
            "as is",
            "--",
            *run_args,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert (tmp_path / "afile").read_text() == "a user's notes\n"
    assert not (tmp_path / "wi").exists()


def test_whatif_refuses_an_out_holding_the_forks_of_another_load_or_checkpoint(
    synthetic_corpus, tmp_path
):
    import shutil

    base = six_iterations(synthetic_corpus)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_main(*base, f"--save={a}", "--save_interval=1", "--exit_interval=2")
    shutil.copytree(a, b)  # the same weights at another path: still another --load
    out = str(tmp_path / "wi")

    def whatif_from(load):
        return whatif.main(
            ["--load", load, "--iters=1", "--out", out, "--forks", "as is", "--", *base]
        )

    assert [r[3] for r in whatif_from(a)] == [True]
    assert [r[3] for r in whatif_from(a)] == [True]  # a rerun of the same: its own forks reused
    with pytest.raises(
        ValueError, match=r"holds the forks of .*/a at global_step2, not of .*/b at "
    ):
        whatif_from(b)
    with open(os.path.join(a, "latest"), "w") as f:  # the same --load at another checkpoint
        f.write("global_step1\n")
    with pytest.raises(
        ValueError, match=r"at global_step2, not of .*/a at global_step1; give a new"
    ):
        whatif_from(a)
    assert json.load(open(os.path.join(out, "whatif.json"))) == {
        "load": os.path.realpath(a),
        "tag": "global_step2",
        "forks": {"as is": base},
    }


def test_whatif_refuses_a_bad_flag_value_or_an_out_under_a_file_before_any_work(tmp_path):
    """The values were checked by the fork that uses them, after --out was made and the others ran;
    an --out under a file was a NotADirectoryError traceback."""
    load = _fake_checkpoint(tmp_path / "run")
    out = tmp_path / "wi"
    (tmp_path / "afile").write_text("a user's notes\n")
    for flags, said in [
        (["--iters=0"], "--iters 0 must be at least 1: iterations per fork"),
        (["--iters=1", "--skip=-3"], "--skip -3 must be at least 1: the iterations the 'skip 200'"),
        (["--iters=1", "--lr_factor=0"], "--lr_factor 0.0 must be above 0: the LR's multiplier"),
        (["--iters=1", "--soft_skip_ratio=0.5"], "--soft_skip_ratio 0.5 must be at least 1: a "),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(said)):
            whatif.main(["--load", load, *flags, "--out", str(out), "--", "--num_layers=1"])
    assert not out.exists()
    under = tmp_path / "afile" / "wi"
    with pytest.raises(
        ValueError, match=re.escape(f"--out={under} cannot be created: {tmp_path / 'afile'} is a")
    ):
        whatif.main(["--load", load, "--iters=1", "--out", str(under), "--", "--num_layers=1"])


def test_whatif_reads_the_run_state_of_a_checkpoint_of_several_ranks(tmp_path, monkeypatch):
    """Its forks (one process each) reshard the checkpoint as any resume does; the tool read its run state
    through checkpoint.load, which refused every checkpoint not saved by one process (TP, PP or DP > 1)
    with "load it with reshard.load"."""
    layout = [*TINY, "--num_layers=2", "--tensor_model_parallel_size=2"]
    write_checkpoint(str(tmp_path / "run"), layout, lambda stage: None, iteration=2)

    class Forked(Exception):
        """The first fork starts: the checkpoint was read."""

    def fork(name, *args):
        raise Forked(name)

    monkeypatch.setattr(whatif, "run_fork", fork)
    args = ["--load", str(tmp_path / "run"), "--iters=1", "--out", str(tmp_path / "wi")]
    with pytest.raises(Forked, match="as is"):
        whatif.main([*args, "--forks", "as is", "--", *layout])


def test_whatif_reads_a_relative_load_and_out_from_the_cwd_as_its_forks_do(
    synthetic_corpus, tmp_path, monkeypatch
):
    """The tool read them from the cwd, its forks (train.py, run from the repository's root) from
    the root: a fork found no checkpoint, or saved into ROOT/OUT; a relative data_path after `--`
    was another file for the forks."""
    base = six_iterations(synthetic_corpus)
    run_main(*base, f"--save={tmp_path / 'a'}", "--save_interval=2", "--exit_interval=2")
    for suffix in (".bin", ".idx"):
        shutil.copy(synthetic_corpus + suffix, tmp_path / f"corpus{suffix}")
    monkeypatch.chdir(tmp_path)
    relative = [a for a in base if not a.startswith("--data_path=")] + ["--data_path=corpus"]
    results = whatif.main(
        ["--load", "a", "--iters=1", "--out", "wi", "--forks", "as is", "--", *relative]
    )
    assert [r[3] for r in results] == [True]
    assert checkpoint.latest_dir(str(tmp_path / "wi" / "as_is")).endswith("global_step3")
    assert not os.path.exists(os.path.join(ROOT, "wi"))


def test_a_failed_fork_is_one_line_naming_its_log(synthetic_corpus, tmp_path):
    """It was a RuntimeError traceback holding the fork's last 2000 characters of stderr."""
    base = six_iterations(synthetic_corpus)
    load = str(tmp_path / "a")
    run_main(*base, f"--save={load}", "--save_interval=2", "--exit_interval=2")
    out = tmp_path / "wi"
    missing = tmp_path / "no_such_corpus"
    args = ["--load", load, "--iters=1", "--out", str(out), "--forks", "as is", "--"]
    proc = tool_cli("whatif.py", *args, *base, f"--data_path={missing}")
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: fork 'as is' failed (exit ") and str(missing) in line, line
    assert line.endswith(f"; its output: {out / 'as_is.log'}") and "Traceback" not in proc.stderr


def test_whatif_refuses_to_report_a_fork_run_with_other_arguments_as_these(
    synthetic_corpus, tmp_path
):
    """A rerun into the same --out with another --lr_factor, or other run arguments after `--`,
    reused (or resumed) the forks the first run made and reported them under the new arguments."""
    base = six_iterations(synthetic_corpus)
    load = str(tmp_path / "a")
    run_main(*base, f"--save={load}", "--save_interval=2", "--exit_interval=2")
    out = str(tmp_path / "wi")

    def whatif_with(*flags, run_args=base):
        args = ["--load", load, "--iters=1", "--out", out, "--forks", "as is,lr x F", *flags]
        return whatif.main([*args, "--", *run_args])

    assert [r[3] for r in whatif_with("--lr_factor=0.5")] == [True, True]
    for flags, run_args, fork in [
        (["--lr_factor=0.25"], base, "lr x F"),
        (["--lr_factor=0.5"], [*base, "--clip_grad=1.0"], "as is"),
    ]:
        with pytest.raises(ValueError, match=f"^--out {re.escape(out)} holds the fork '{fork}' "):
            whatif_with(*flags, run_args=run_args)
    logs = {name: open(os.path.join(out, name)).read() for name in ("as_is.log", "lr_x_F.log")}
    assert [r[3] for r in whatif_with("--lr_factor=0.5")] == [True, True]  # the same: reused
    assert logs == {name: open(os.path.join(out, name)).read() for name in logs}


def test_whatif_with_fewer_iters_than_its_forks_ran_reports_those_iterations(
    synthetic_corpus, tmp_path
):
    """A rerun with a smaller --iters reused the forks as they were: the table, headed with the new
    --iters, showed the longer run's iterations and said the fork had not got through."""
    base = six_iterations(synthetic_corpus)
    load = str(tmp_path / "a")
    run_main(*base, f"--save={load}", "--save_interval=2", "--exit_interval=2")
    out = str(tmp_path / "wi")

    def whatif_for(iters):
        args = ["--load", load, f"--iters={iters}", "--out", out, "--forks", "as is", "--", *base]
        return whatif.main(args)

    ((_, longer, _, reached),) = whatif_for(2)
    assert [it for it, *_ in longer] == [3, 4] and reached
    ((_, shorter, _, reached),) = whatif_for(1)
    assert shorter == longer[:1] and reached
