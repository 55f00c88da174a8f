"""docs/forking.md's stability check, run as the page writes it: its file (its class and its
section, its key) and its registry line applied to a copy of the product, then `--help`, short runs
of the small model with the key on the command line, and the state it keeps in the checkpoint."""

import os
import re
import shutil

import pytest
import torch

from helpers import ROOT, SMALL, corpus, losses, run_python  # noqa: F401 (corpus: a fixture)


def _example():
    """(the module's code, the registry line) of the page's "A stability check"."""
    with open(os.path.join(ROOT, "docs", "forking.md")) as f:
        section = f.read().split("## A stability check", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[:2]


def _forked(tmp_path):
    """A copy of the product (its modules and config files), the page's check added as it says: its
    file and its registry line, nothing else."""
    fork = tmp_path / "fork"
    shutil.copytree(
        ROOT,
        fork,
        ignore=lambda d, names: [
            n
            for n in names
            if not (
                n.endswith(".py")
                or os.path.isdir(os.path.join(d, n))
                and n in ("stability", "config")
            )
        ],
    )
    module, line = _example()
    (fork / "stability" / "loss_cap.py").write_text(module)
    registry = fork / "stability" / "__init__.py"
    after_guard = '        "guard.Guard",\n    ),\n'
    text = registry.read_text()
    assert after_guard in text, f"{after_guard!r} is not in {registry}"
    registry.write_text(text.replace(after_guard, after_guard + line, 1))
    return fork


def _run(fork, *args):
    proc = run_python(1, ["train.py", *args], {**os.environ, "OMP_NUM_THREADS": "1"}, cwd=fork)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # three runs of a copy of train.py (and --help): about 25 s on 2 cores
def test_the_pages_stability_check_with_its_key_is_built_keeps_its_state_and_vetoes(
    corpus, tmp_path
):
    fork = _forked(tmp_path)
    assert re.search(
        r"^  --loss_cap +float = 0.0 +veto the update of a step", _run(fork, "--help"), re.M
    )
    args = [*SMALL, f"--data_path={corpus}", "--train_iters=4", "--eval_iters=0"]
    out = _run(fork, *args, "--loss_cap=3", f"--save={tmp_path / 'kept'}", "--save_interval=4")
    state = torch.load(
        tmp_path / "kept" / "global_step4" / "mp_rank_00_000_model_states.pt", weights_only=False
    )
    # its own entry in the checkpoint
    first = state["run"]["state"]["callbacks"]["loss_cap"]["first"]
    assert abs(first - float(losses(out)[1])) < 1e-3 * first
    assert state["run"]["config"]["loss_cap"] == 3.0
    assert "loss cap:" not in out  # a clean start is far from 3x its first loss
    out = _run(fork, *args, "--loss_cap=0.5", "--spike_guard")  # every loss is above half the first
    assert len(re.findall(r"^loss cap: loss \S+ is over 0.5x the first loss", out, re.M)) == 4, out[
        -3000:
    ]
    assert "spike guard: iteration" not in out  # the guard leaves another callback's veto alone
