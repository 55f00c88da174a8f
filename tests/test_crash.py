"""A rank that fails ends the job, and a run stopped on purpose ends clean. Under torchrun the others do not wait
in a collective for distributed_timeout_minutes (a hung 104B job idles every GPU meanwhile). Under srun,
`--kill-on-bad-exit=1` in docs/parallelism.md's recipe does what torchrun's agent does here (tests/test_safety.py
checks the recipe has it)."""

import os
import subprocess

import pytest

import builders
import training
from helpers import E2E_ARGS, ROOT, SMALL, corpus, run_main, synthetic_corpus, torchrun  # noqa: F401 (fixtures)

# train.py on each rank, its second step failing on rank 1 as a lost GPU would (an exception out of the step)
FAILING_RANK = """
import os, runpy, sys
sys.path.insert(0, os.getcwd())  # the repository: the job runs there
import training
step, calls = training.train_step, []
def failing(*args, **kwargs):
    calls.append(1)
    if int(os.environ["RANK"]) == 1 and len(calls) == 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return step(*args, **kwargs)
training.train_step = failing
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_one_failing_rank_ends_a_torchrun_job(synthetic_corpus, tmp_path):
    """The job ends with the failing rank's error long before the 10-minute collective timeout (this test's
    subprocess would time out first): the failing rank's process groups are torn down without a barrier, and
    torchrun stops the other rank."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    # train.py's loop looks train_step up in its own namespace: the script patches training before train.py runs
    cmd = [
        *torchrun(2),
        str(script),
        *E2E_ARGS,
        f"--data_path={synthetic_corpus}",
        "--train_iters=6",
        "--log_interval=1",
    ]
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "an illegal memory access was encountered (injected)" in out, out[-3000:]
    # stopped at the failure
    assert " iteration        1/" in out and " iteration        2/" not in out, out[-3000:]


class StopsAtTwo(training.Callback):
    """Stops the run on purpose at its second iteration, as the spike guard at a cap does (having saved)."""

    def after_step(self, it, step):
        if it.number == 2:
            raise training.StopRun("stopped on purpose")
        return False


def test_a_callback_that_stops_the_run_leaves_no_thread_loading(corpus, monkeypatch):
    """The batch prefetcher's thread is joined however the loop ends: a thread still loading when the process exits
    can abort it ("terminate called without an active exception", exit 134 instead of the stop's 3)."""
    import threading

    monkeypatch.setattr(
        builders, "build_callbacks", lambda *args: training.Callbacks([StopsAtTwo()])
    )
    with pytest.raises(training.StopRun, match="stopped on purpose"):
        run_main(*SMALL, f"--data_path={corpus}", "--train_iters=5")
    assert [
        t.name for t in threading.enumerate() if t.name == "batch-prefetch" and t.is_alive()
    ] == []
