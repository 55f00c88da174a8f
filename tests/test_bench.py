"""bench.py's costs: one profiled iteration's time split into shares (bench.COSTS), checked against work whose
share is known by construction (sleeps, one kind of op at a time), and on a real tiny model."""
import time

import pytest
import torch
import torch.nn.functional as F

import bench
import cross_entropy
import optim
import parallel
from helpers import corpus  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


class Optimizer:
    """What costs_named wraps: an optimizer's step (here an elementwise op that only the range can place)."""

    def __init__(self):
        self.w = torch.zeros(1 << 16)

    def step(self):
        self.w.add_(1.0)


def shares(run, fetch=lambda: None, optimizer=None):
    costs = bench.step_costs(fetch, run, optimizer or Optimizer(), CPU)
    assert list(costs) == list(bench.COSTS)
    assert all(share >= 0 for share in costs.values()), costs
    assert sum(costs.values()) == pytest.approx(1.0, abs=1e-9), costs
    return costs


def test_sleeps_are_data_wait_and_other():
    """A batch that takes 0.2 s to come is the data wait; 0.2 s of Python in the step that no op accounts for
    is "other"; the few ops are the rest."""
    a = torch.randn(64, 64)

    def run(_):
        a @ a
        time.sleep(0.2)

    costs = shares(run, fetch=lambda: time.sleep(0.2))
    assert 0.4 < costs["data wait"] < 0.5 and 0.4 < costs["other"] < 0.55, costs


def test_each_kind_of_op_goes_to_its_share():
    q = torch.randn(2, 4, 256, 32)
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    optimizer = Optimizer()

    def attention(_):
        for _ in range(20):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def matmuls(_):
        for _ in range(20):
            F.linear(a, w)

    def elementwise(_):
        for _ in range(20):
            F.gelu(a).add_(1)

    def step(_):
        for _ in range(20):
            optimizer.step()

    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)

    def clip(_):  # train_step's clipping goes through optim.clip_grads: the optimizer's share
        for _ in range(20):
            optim.clip_grads(params, 1.0, torch.tensor(1e3))

    def output_layer(_):
        hidden = torch.randn(64, 32, requires_grad=True)
        weight = torch.randn(4096, 32, requires_grad=True)
        target = torch.randint(0, 4000, (64,))
        loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, target, 4000, reduction="mean")
        loss.backward()

    # besides its own: "other" (Python), the data wait (fetching nothing), small ops (the loss's zeros, ...), and
    # the loss's backward ends in its two leaves' AccumulateGrad
    elsewhere = ("other", "data wait", "elementwise and other ops", "gradient accumulation / reduction")
    for run, cost in ((attention, "attention"), (matmuls, "other matmuls"), (elementwise, "elementwise and other ops"),
                      (step, "optimizer"), (clip, "optimizer"), (output_layer, "output layer + loss")):
        costs = shares(run, optimizer=optimizer)
        assert costs[cost] > 0.5 and costs["other"] < 0.5, (cost, costs)
        assert all(share == 0 for c, share in costs.items() if c not in (cost, *elsewhere)), (cost, costs)
        assert costs["gradient accumulation / reduction"] < 0.05, (cost, costs)


def test_the_named_parts_are_undone():
    optimizer, grad_norm, clip = Optimizer(), parallel.grad_norm, optim.clip_grads
    shares(lambda _: optimizer.step(), optimizer=optimizer)
    assert "step" not in vars(optimizer) and parallel.grad_norm is grad_norm and optim.clip_grads is clip


def test_bench_table_says_where_a_tiny_models_step_goes(corpus, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(bench, "device_peak", lambda device, dtype: (1e12, "not measured"))  # seconds of matmuls
    rows = bench.table(["config/tiny.py", "--num_layers=1", "--hidden_size=32", "--num_attention_heads=2",
                        "--seq_length=16", "--micro_batch_size=2", "--global_batch_size=4", "--bench_steps=1",
                        "--bench_warmup=0", f"--data_path={corpus}"])
    costs = rows[0][1]["costs"]
    assert list(costs) == list(bench.COSTS) and all(share >= 0 for share in costs.values()), costs
    assert sum(costs.values()) == pytest.approx(1.0, abs=1e-9)
    for cost in ("output layer + loss", "attention", "other matmuls", "elementwise and other ops", "optimizer",
                 "gradient accumulation / reduction"):
        assert costs[cost] > 0, (cost, costs)
    out = capsys.readouterr().out
    assert "| config | " + " | ".join(bench.COSTS) + " |" in out and "\n| tiny | " in out
