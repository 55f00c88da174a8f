"""docs/forking.md's stability check, run as the page writes it: its class and its registry line, read from the
page, in a short run of the tiny model with the spike guard on."""
import os
import re
import sys
import textwrap
import types

import torch

import stability
from helpers import ROOT, SMALL, corpus, losses, run_main  # noqa: F401 (corpus: a fixture)


def _example():
    """(the module's code, the registry line) of the page's section "A stability check"."""
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        section = f.read().split("## A stability check", 1)[1]
    module, line = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    return module, line


def _install(monkeypatch, cap=None):
    """The page's module as stability.loss_cap, its line after the guard's in REGISTRY; returns the class."""
    code, line = _example()
    module = types.ModuleType("stability.loss_cap")
    exec(compile(code, "docs/forking.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "stability.loss_cap", module)
    entry, = eval(textwrap.dedent(line))
    registry = list(stability.REGISTRY)
    registry.insert(1 + next(i for i, (_, where) in enumerate(registry) if where == "guard.Guard"), entry)
    monkeypatch.setattr(stability, "REGISTRY", registry)
    if cap is not None:
        monkeypatch.setattr(module.LossCap, "CAP", cap)
    return module.LossCap


def test_the_pages_stability_check_is_built_keeps_its_state_and_vetoes(monkeypatch, corpus, tmp_path):
    _install(monkeypatch)
    args = [*SMALL, f"--data_path={corpus}", "--train_iters=4", "--eval_iters=0", "--spike_guard"]
    out = run_main(*args, f"--save={tmp_path / 'kept'}", "--save_interval=4")
    state = torch.load(tmp_path / "kept" / "global_step4" / "mp_rank_00_000_model_states.pt", weights_only=False)
    first = state["run"]["state"]["callbacks"]["loss_cap"]["first"]  # its own entry in the checkpoint
    assert abs(first - float(losses(out)[1])) < 1e-3 * first
    assert "loss cap:" not in out  # a clean start is nowhere near 3x its first loss
    _install(monkeypatch, cap=0.5)  # every loss is above half the first: every update vetoed
    out = run_main(*args)
    assert len(re.findall(r"^loss cap: loss \S+ is over 0.5x the first loss", out, re.M)) == 4, out[-3000:]
    assert "spike guard: iteration" not in out  # the guard leaves another callback's veto alone
