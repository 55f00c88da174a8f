"""inject_lost_optimizer_state_iter (stability/faults.py): a resume whose Adam moments are lost. Against the run's
own references: the moments the optimizer held before (zeroed, the step count kept) and an uninterrupted clean run
(the same losses up to the fault's step, other ones after it)."""

import torch

import arguments
import optim
from builders import build_model, build_optimizer, step_rules
from helpers import (  # noqa: F401 (corpus, corpus512: fixtures)
    corpus,
    corpus512,
    losses,
    random_batches,
    run_main,
    spike_guard_of,
)
from stability.faults import Faults
from training import whole_step

TINY = [
    "--num_layers=1",
    "--hidden_size=32",
    "--num_attention_heads=2",
    "--seq_length=16",
    "--vocab_size=512",
    "--micro_batch_size=2",
]


def _steps(cfg, model, optimizer, n, seed):
    """n whole steps on random batches (the grad buffer's path: a bare backward would leave the optimizer with no
    gradient, so no state, and every check below over an empty dict)."""
    for k in range(n):
        batches = random_batches(seed + k, 1, cfg.micro_batch_size, cfg.seq_length, cfg.vocab_size)
        step = whole_step(
            model,
            optimizer,
            optim.scaler_for(cfg),
            batches,
            1e-3,
            step_rules(cfg),
            torch.device("cpu"),
        )
        assert step.outcome == "ok", step.outcome


def test_the_moments_are_zeroed_once_in_time_and_the_step_count_kept():
    cfg = arguments.prepare(arguments.load_config([*TINY, "--inject_lost_optimizer_state_iter=4"]))
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    _steps(cfg, model, optimizer, 3, seed=0)
    states = optimizer.state
    assert len(states) == len(list(model.parameters())), "every parameter holds its moments"
    steps = {id(p): torch.as_tensor(s["step"]).clone() for p, s in states.items()}
    assert all(int(step) == 3 for step in steps.values())
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in states.values())
    guard = spike_guard_of(cfg)
    faults = Faults(cfg, None, cfg.seed, cfg.vocab_size)
    faults.optimizer = optimizer
    faults.lose_optimizer_state(3, guard)  # not its iteration: untouched
    assert all(s["exp_avg"].abs().sum() > 0 for s in states.values())
    faults.lose_optimizer_state(4, guard)
    for p, s in states.items():
        assert not s["exp_avg"].any() and not s["exp_avg_sq"].any()
        assert torch.equal(
            torch.as_tensor(s["step"]), steps[id(p)]
        )  # bias correction goes on at step 4
    _steps(cfg, model, optimizer, 1, seed=3)
    # the iteration has been run: met again (a rollback's replay), it is not a fault anew
    guard.last_run = 4
    faults.lose_optimizer_state(4, guard)
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in states.values())


def test_a_resume_that_loses_the_moments_departs_from_the_clean_run_after_its_step(
    corpus512, tmp_path
):
    base = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=32",
        "--vocab_size=512",
        "--micro_batch_size=4",
        "--global_batch_size=4",
        "--train_iters=10",
        "--lr=2e-3",
        "--lr_warmup_samples=8",
        "--lr_decay_samples=40",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--log_interval=1",
        "--eval_interval=1000",
        "--eval_iters=1",
        "--sample_tokens=0",
        f"--data_path={corpus512}",
    ]
    clean = losses(run_main(*base, "--save=none", "--save_interval=none"))
    save = str(tmp_path / "ckpt")
    first = losses(run_main(*base, f"--save={save}", "--save_interval=6", "--exit_interval=6"))
    lost_out = run_main(
        *base, f"--save={save}", "--save_interval=none", "--inject_lost_optimizer_state_iter=7"
    )
    lost = losses(lost_out)
    assert lost_out.count("injected a lost optimizer state") == 1
    assert {i: first[i] for i in range(1, 7)} == {i: clean[i] for i in range(1, 7)}
    assert lost[7] == clean[7]  # the loss before the step that meets the zeroed moments
    assert all(lost[i] != clean[i] for i in range(8, 11))
