"""The straggler line: each DP replica's compute time rides in the step's one all-gather (training.agree), and at a
log interval the slowest replica names itself -- its rank and host -- when it computed over 1.2x the replicas'
median. A rank slowed on purpose on 2 gloo processes, and the judgement on numbers given by hand."""

import contextlib
import io
import socket
import time
import types

import parallel
import report
import training
from helpers import E2E_ARGS, spawn, synthetic_corpus, train_script  # noqa: F401 (synthetic_corpus: a fixture)


def _judged(monkeypatch, sums, dp_rank):
    monkeypatch.setattr(parallel, "grid", types.SimpleNamespace(dp_rank=dp_rank, rank=5))
    timer = report.ComputeTimer()
    timer.sums = list(sums)
    return timer.straggler(40)


def test_the_slowest_replica_names_itself_past_the_slack(monkeypatch):
    line = _judged(monkeypatch, [1.0, 1.0, 1.3, 1.0], dp_rank=2)
    assert line == (
        f" straggler at iteration 40: DP rank 2 (rank 5, host {socket.gethostname()}) computed 1.30x "
        "the median of the DP replicas since the last log line |"
    )
    assert _judged(monkeypatch, [1.0, 1.0, 1.3, 1.0], dp_rank=0) is None  # the others stay silent
    assert _judged(monkeypatch, [1.0, 1.0, 1.19, 1.0], dp_rank=2) is None  # within the slack
    assert _judged(monkeypatch, [1.0], dp_rank=0) is None  # no replica to compare with
    timer = report.ComputeTimer()
    timer.gathered([0.0, 0.0])  # the first gather carries the reading before any step: not counted
    timer.gathered([2.0, 3.0])
    timer.gathered([4.0, 1.0])
    # cleared each interval
    assert timer.sums == [6.0, 4.0] and timer.straggler(1) is None and timer.sums is None


def _slowed_run(corpus, slow_rank):
    """train.py on this rank, its forward and backward slowed by 1 s a step on DP rank slow_rank: the first log
    line judges one step, which the other rank's must not approach however the machine is loaded."""
    original = training.forward_backward

    def slowed(*args, **kwargs):
        if parallel.grid.dp_rank == slow_rank:
            time.sleep(1.0)
        return original(*args, **kwargs)

    training.forward_backward = slowed  # train_step's lookup: the training module's namespace
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train_script()["main"](
                [
                    *E2E_ARGS,
                    f"--data_path={corpus}",
                    "--train_iters=4",
                    "--log_interval=2",
                    "--eval_iters=0",
                ]
            )
    finally:
        training.forward_backward = original
    lines = [line for line in out.getvalue().splitlines() if "straggler" in line]
    if parallel.grid.dp_rank == slow_rank:
        assert len(lines) == 2, out.getvalue()[-3000:]  # at both log lines
        assert all(
            f"DP rank {slow_rank} (rank {parallel.grid.rank}, host {socket.gethostname()})" in line
            for line in lines
        ), lines
    else:
        assert lines == [], lines


def test_a_rank_slowed_on_purpose_is_named_at_each_log_line(synthetic_corpus):
    spawn(_slowed_run, 2, 1, 1, synthetic_corpus, 1)
