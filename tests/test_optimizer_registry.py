"""The optimizer registry (optim.OPTIMIZERS): docs/forking.md's third optimizer, Lion, added as the
page writes it -- its update against the paper's formula, a run of the small model with it resumed
bit for bit, the spike guard's weight bound and the reset's "auto" following its entry -- a
checkpoint of one optimizer refused when resumed as another, by name, and "auto" refused under an
entry that declares no count."""

import dataclasses
import os
import re
import textwrap

import pytest
import torch

import arguments
import deepspeed_engine
import optim
import parallel
from helpers import (  # noqa: F401 (a fixture)
    ROOT,
    SMALL,
    assert_same_checkpoint,
    corpus,
    losses,
    run_main,
    snapshots_of,
    spike_guard_of,
)
from optim import OptimizerConfig
from sections import section
from stability import diagnosis


def _register_lion(monkeypatch):
    """The page's Lion class, run in optim.py's namespace as the page puts it there, and its line in
    OPTIMIZERS, for this test only; returns the class."""
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        section = f.read().split("## An optimizer", 1)[1].split("\n## ", 1)[0]
    code, line = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    namespace = dict(vars(optim))
    exec(compile(code, "docs/forking.md", "exec"), namespace)
    ((name, entry),) = eval("{" + textwrap.dedent(line) + "}", namespace).items()
    monkeypatch.setitem(optim.OPTIMIZERS, name, entry)
    return namespace["Lion"]


def _lion_reference(params, momenta, grads, lr, weight_decays, beta1, beta2):
    """One Lion step in plain torch (Chen et al. 2023, Algorithm 2, decoupled weight decay)."""
    for i, (p, m, g, wd) in enumerate(zip(params, momenta, grads, weight_decays)):
        params[i] = p * (1 - lr * wd) - lr * torch.sign(beta1 * m + (1 - beta1) * g)
        momenta[i] = beta2 * m + (1 - beta2) * g


def test_the_pages_lion_steps_as_the_papers_formula(monkeypatch):
    _register_lion(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    # lr 1e-2, weight_decay 0.1, then the values of Lion's keys: adam_beta1, adam_beta2
    opt = optim.build_optimizer(model, 1e-2, 0.1, 0.9, 0.99, optimizer="lion")
    initial = [p.detach().clone() for p in model.parameters()]
    params, momenta = list(initial), [torch.zeros_like(p) for p in initial]
    decays = [0.1 if p.ndim >= 2 else 0.0 for p in params]  # none on biases and norms (Megatron)
    gen = torch.Generator().manual_seed(1)
    for lr in (1e-2, 5e-3, 2e-2, 1e-2, 1e-3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optim.set_lr(opt, lr)
        opt.step()
        _lion_reference(params, momenta, grads, lr, decays, 0.9, 0.99)
    for p, ref, m in zip(model.parameters(), params, momenta):
        torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
        assert set(opt.state[p]) == {"exp_avg"}  # Lion's one state tensor, not AdamW's two
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-6, atol=1e-7)
    # each weight moved by up to 4.8e-2 (five sign steps): far beyond the tolerance above
    assert min((p - q).abs().max().item() for p, q in zip(model.parameters(), initial)) > 1e-2


def test_a_run_with_lion_resumes_bit_exact_and_is_refused_as_adamw(monkeypatch, corpus, tmp_path):
    _register_lion(monkeypatch)
    args = [*SMALL, f"--data_path={corpus}", "--eval_iters=0", "--optimizer=lion", "--lr=3e-4"]
    a, b, c = (f"--save={tmp_path / d}" for d in "abc")
    full = losses(run_main(*args, "--train_iters=4", a, "--save_interval=4"))
    run_main(*args, "--train_iters=2", b, "--save_interval=2")
    resumed = losses(run_main(*args, "--train_iters=4", b, "--save_interval=2"))
    assert {i: full[i] for i in (3, 4)} == resumed
    # weights, Lion's momentum, the RNG streams: bit for bit
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b", 4)
    state = torch.load(
        tmp_path / "b" / "global_step2" / "mp_rank_00_000_model_states.pt", weights_only=False
    )
    assert state["run"]["config"]["optimizer"] == "lion"  # the checkpoint names its optimizer

    adamw = [x for x in args if "lion" not in x] + ["--train_iters=5", f"--load={tmp_path}/b"]
    with pytest.raises(
        ValueError,
        match=r"^the checkpoint's optimizer state is lion's, but this "
        r"run's optimizer is adamw, which cannot continue from "
        r"it; resume with optimizer='lion', or set no_load_optim",
    ):
        run_main(*adamw, c)
    out = run_main(*adamw, c, "--no_load_optim")  # the fix it names: a fresh AdamW, Lion's weights
    assert "optimizer state not loaded" in out and list(losses(out)) == [5]


def _moved(guard, optimizer, times, *values):
    """corrupted_weights after one weight of a small model moved `times` the most the guard allows
    an optimizer of bound 1 since a snapshot (2 x the LRs summed since, x 1, and fp32's rounding);
    values: those of the optimizer's keys."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = optim.build_optimizer(model, 1e-3, 0.0, *values, optimizer=optimizer)
    then_sum, lr_sum = 0.25, 3e-3
    guard.lr_sum = then_sum + lr_sum
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    payload = (before, {"state": {"spike_guard": {"stats": {"lr sum": then_sum}}}})
    old = float(before["weight"].view(-1)[7])
    move = 2 * lr_sum * 1.0
    allowed = move + 4 * torch.finfo(torch.float32).eps * (abs(old) + move)
    with torch.no_grad():
        model.weight.view(-1)[7] = old + allowed * times
    return diagnosis.corrupted_weights(guard, model, opt, 40, 35, payload, say=False)


@pytest.mark.parametrize("beyond", [False, True])
def test_under_lion_the_guard_bounds_a_weights_move_by_lions_step_not_adams(monkeypatch, beyond):
    """Lion moves a weight by lr x a sign: since a snapshot, by at most the LRs summed (x2, the
    guard's margin). A weight 1% inside that is the optimizer's; 1% past it, something else's --
    which Adam's formula at Lion's betas (2.3 at 0.9, 0.99) would have let pass."""
    _register_lion(monkeypatch)
    flags = ["--spike_guard", "--optimizer=lion", "--adam_beta2=0.99", "--weight_decay=0"]
    guard = spike_guard_of(arguments.load_config(flags))
    assert guard.step_bound == 1.0 < optim.adam_bound(0.9, 0.99)
    found = _moved(guard, "lion", 1.01 if beyond else 0.99, 0.9, 0.99)
    assert (found is not None) == beyond, found


def test_under_lion_auto_is_its_entrys_count(monkeypatch):
    """The page's entry: 5 / (1 - beta2) on Lion's one moment, for a resume's reset and the spike
    guard's; a count given is the count."""
    _register_lion(monkeypatch)
    flags = ["--spike_guard", "--spike_guard_reset_optimizer", "--optimizer=lion"]
    cfg = arguments.load_config([*flags, "--adam_beta2=0.99"])
    assert optim.reset_warmup_iters(section(OptimizerConfig, cfg), "auto") == 500
    assert optim.reset_warmup_iters(section(OptimizerConfig, cfg), 7) == 7
    assert snapshots_of(cfg).reset_warmup == 500  # a relapse's reset, "auto" when unset
    # the entry's, not Adam's formula on the same beta2: another count in the entry is followed
    entry = dataclasses.replace(optim.OPTIMIZERS["lion"], reset_iters=lambda b1, b2: 42)
    monkeypatch.setitem(optim.OPTIMIZERS, "lion", entry)
    assert optim.reset_warmup_iters(section(OptimizerConfig, cfg), "auto") == 42
    assert snapshots_of(cfg).reset_warmup == 42


def _register_fork(monkeypatch):
    """A fork's optimizer whose entry declares neither rule (AdamW's make and keys, for a cheap run)."""
    entry = optim.OptimizerEntry(optim.AdamW, optim.ADAM_KEYS, optim.adam_options)
    monkeypatch.setitem(optim.OPTIMIZERS, "fork", entry)


AUTO_REFUSED = (
    r"^reset_optimizer_warmup_iters='auto'{} is the lr=0 iterations the optimizer's state needs "
    r"after a reset, which optimizer='fork' does not declare \(its OPTIMIZERS entry has no "
    r"reset_iters\): give reset_optimizer_warmup_iters a count of iterations \(e.g. 100\), or "
    r"declare reset_iters in its entry$"
)


def test_auto_under_an_entry_that_declares_no_count_is_refused_before_the_run(
    monkeypatch, corpus, tmp_path
):
    _register_fork(monkeypatch)
    args = [*SMALL, f"--data_path={corpus}", "--eval_iters=0", "--optimizer=fork"]
    resume = [*args, "--train_iters=2", f"--load={tmp_path}", f"--save={tmp_path}"]
    with pytest.raises(ValueError, match=AUTO_REFUSED.format("")):
        run_main(*resume, "--reset_optimizer_warmup_iters=auto")
    assert not os.listdir(tmp_path)  # nothing saved: no iteration ran
    # the spike guard resets a relapse with "auto" when the key is unset: refused when it would
    cfg = arguments.load_config(["--spike_guard", "--optimizer=fork"])
    guard = spike_guard_of(cfg)
    assert (
        guard.step_bound is None and _moved(guard, "fork", 1e3, 0.9, 0.999, 1e-8) is None
    )  # no weight test
    assert snapshots_of(cfg).reset_warmup == 0  # no reset asked of it
    cfg.spike_guard_reset_optimizer = True
    unset = r" \(unset: what spike_guard_reset_optimizer resets with\)"
    with pytest.raises(ValueError, match=AUTO_REFUSED.format(unset)):
        snapshots_of(cfg)


def test_an_older_checkpoint_without_the_key_is_adamws_or_with_use_bnb_optimizer_8_bit():
    cfg = arguments.derive(arguments.load_config(["--train_iters=1"]))
    assert cfg.optimizer == "adamw" and not cfg.use_bnb_optimizer
    # the migration: a checkpoint written before the registry, whose config has no `optimizer`
    assert optim.checkpoint_optimizer({}) == "adamw"
    assert optim.resume_adam_params(None, cfg, {"adam_beta2": cfg.adam_beta2}) is None
    with pytest.raises(ValueError, match=r"is adamw8bit's, but this run's optimizer is adamw"):
        optim.resume_adam_params(None, cfg, {"use_bnb_optimizer": True})
    bnb = arguments.derive(arguments.load_config(["--train_iters=1", "--use_bnb_optimizer"]))
    assert bnb.optimizer == "adamw8bit" and bnb.use_bnb_optimizer  # the shortcut, recorded by name
    assert optim.resume_adam_params(None, bnb, {"use_bnb_optimizer": True}) is None
    with pytest.raises(ValueError, match=r"is adamw's, but this run's optimizer is adamw8bit"):
        optim.resume_adam_params(None, bnb, {"optimizer": "adamw"})


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--optimizer=sgd"],
            r"optimizer='sgd' is not one of adamw, adamw8bit; pick one, or regis",
        ),
        (
            ["--optimizer=adamw", "--use_bnb_optimizer"],
            r"use_bnb_optimizer asks for optimizer='adamw8bit' but optimizer='adamw'; unset one of them",
        ),
    ],
)
def test_an_unknown_or_contradicted_optimizer_is_refused_before_anything_runs(flags, message):
    with pytest.raises(ValueError, match=message):
        arguments.validate(arguments.load_config(["--train_iters=1", *flags]))


def test_deepspeed_refuses_an_optimizer_not_declared_elementwise_by_name(monkeypatch):
    grid = parallel.Grid(1, 1, world_size=2)
    cfg = arguments.load_config(
        ["--deepspeed", "--bf16", "--zero_stage=1", "--optimizer=adamw8bit"]
    )
    with pytest.raises(ValueError, match=r"optimizer='adamw8bit' with deepspeed=True is not suppo"):
        deepspeed_engine.check(section(OptimizerConfig, cfg), cfg.zero_stage, grid)
    # a fork's entry that does not declare elementwise=True
    monkeypatch.setitem(optim.OPTIMIZERS, "other", optim.OptimizerEntry(optim.AdamW))
    cfg.optimizer = "other"
    with pytest.raises(ValueError, match=r"'other' with deepspeed=True .*OPTIMIZERS\['other'\]"):
        deepspeed_engine.check(section(OptimizerConfig, cfg), cfg.zero_stage, grid)
    cfg.optimizer = "adamw"
    # ours is elementwise
    deepspeed_engine.check(section(OptimizerConfig, cfg), cfg.zero_stage, grid)
