"""--profile_steps A-B: a torch.profiler trace (Chrome's format) of iterations A to B next to the run's logs, on
the CPU as on a GPU; the training it watches unchanged; a malformed range refused with the fix."""

import json

import pytest

import arguments
import report
from helpers import SMALL, losses, run_main


@pytest.mark.slow  # ~70 s on a shared 2-core CPU: two short runs, one under the profiler
def test_profile_steps_writes_a_trace_of_those_iterations(tmp_path):
    plain = run_main(*SMALL, "--train_iters=4", f"--tensorboard_dir={tmp_path / 'plain'}")
    out = run_main(
        *SMALL, "--train_iters=4", "--profile_steps=2-3", f"--tensorboard_dir={tmp_path / 'tb'}"
    )
    assert losses(out) == losses(plain)  # watched, not changed
    trace = tmp_path / "tb" / "profile" / "rank0.trace.json"
    assert f"profile of iterations 2-3: {tmp_path / 'tb' / 'profile'}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    # the model's matmuls were recorded
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)
    # two iterations' worth: the optimizer's steps (one each) seen twice, not once nor four times
    steps = [e for e in events if e.get("name", "").startswith("Optimizer.step#")]
    assert len(steps) == 2, sorted({e.get("name") for e in steps})


@pytest.mark.parametrize("text", ["3", "0-2", "5-4", "a-b", "2-"])
def test_a_malformed_profile_range_is_refused_with_the_fix(text):
    with pytest.raises(ValueError, match="give e.g. --profile_steps=5-7"):
        arguments.validate(arguments.load_config([f"--profile_steps={text}"]))
    assert report.profile_range("5-7") == (5, 7)


def test_a_profile_range_after_the_runs_end_is_a_warning_line(tmp_path):
    """A longer run's profile_steps kept in a config wrote nothing, in silence."""
    out = run_main(
        *SMALL, "--train_iters=2", "--profile_steps=5-6", f"--tensorboard_dir={tmp_path}"
    )
    assert (
        "warning: profile_steps 5-6 starts after the run's last iteration 2: no profile is written"
        in out
    )
    assert not (tmp_path / "profile").exists()
