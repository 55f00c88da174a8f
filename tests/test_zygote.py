"""tests/zygote.py's forked runs against the same runs in a real interpreter: what a script sees of its process
and what the caller sees of its end are the same."""

import os
import signal
import subprocess
import sys
import time

import pytest

import helpers
from helpers import python_for

PROBE = """
import atexit, os, sys, threading
print(sys.argv, __file__, __name__, sys.path[0], os.getcwd(), os.environ.get("PROBE"), os.environ.get("RANK"))
print(sys.modules["__main__"].__file__, type(__loader__).__name__, __spec__, __doc__, __package__)
print("stability" in sys.modules, threading.active_count())
print([(s.line_buffering, s.write_through) for s in (sys.stdout, sys.stderr)], sys.stdout is sys.__stdout__)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (threading.Event().wait(0.2), print("thread joined at exit"))).start()
what = sys.argv[1]
if what == "raise":
    raise ValueError("boom")
if what == "exit":
    sys.exit("bye")
if what == "code":
    sys.exit(7)
if what == "kill":
    sys.stdout.flush()
    os.kill(os.getpid(), 9)
if what == "wait":
    print("waiting", os.getpid(), flush=True)
    threading.Event().wait(60)
"""


@pytest.fixture(autouse=True)
def _servers_past_the_cap(monkeypatch):
    """These tests need their servers, however many environments this pytest process served before."""
    monkeypatch.setattr(helpers, "MAX_ZYGOTES", 1_000)


def both(tmp_path, *args, env=None, unbuffered=False):
    """(real, forked): the probe's CompletedProcess in python and through the zygote."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, PROBE="yes", **(env or {}))
    flags = ["-u"] if unbuffered else []
    runs = []
    for python, run_env in ((sys.executable, env), python_for(env)):
        runs.append(
            subprocess.run(
                [python, *flags, "probe.py", *args],
                cwd=tmp_path,
                env=run_env,
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
    return runs


@pytest.mark.parametrize("what", ["ok", "raise", "exit", "code", "kill"])
def test_a_forked_run_sees_and_ends_as_a_real_one(tmp_path, what):
    real, forked = both(tmp_path, what)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        real.returncode,
        real.stdout,
        real.stderr,
    )
    assert real.returncode == {"ok": 0, "raise": 1, "exit": 1, "code": 7, "kill": -9}[what]


def test_buffering_and_torchruns_rank_variables_as_in_a_real_run(tmp_path):
    for unbuffered, env, streams in (
        (True, {"RANK": "1"}, "[(False, True), (False, True)]"),
        (False, {"PYTHONUNBUFFERED": ""}, "[(False, False), (True, False)]"),
    ):
        real, forked = both(tmp_path, "ok", env=env, unbuffered=unbuffered)
        assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout)
        lines = real.stdout.splitlines()
        assert lines[0].endswith(f" yes {env.get('RANK')}") and lines[3].startswith(streams), lines


def test_a_signal_reaches_the_run_and_a_killed_proxy_takes_its_run_with_it(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    python, env = python_for(dict(os.environ, PROBE="yes"))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen(
            [python, "probe.py", "wait"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
        )
        run = next(int(line.split()[1]) for line in proc.stdout if line.startswith("waiting"))
        assert run != proc.pid
        proc.send_signal(sig)
        # SIGTERM reaches the run, which ends by it; SIGKILL ends the proxy, and the server kills the run
        assert proc.wait(timeout=30) == -sig
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{run}") and time.time() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{run}"), (sig, run)


def test_what_the_server_cannot_serve_runs_in_python(tmp_path):
    """Another environment (a library may read it at import) or another option than -u: a real interpreter, which
    has not imported torch when the script starts."""
    (tmp_path / "preloaded.py").write_text("import sys; print('torch' in sys.modules)")
    python, env = python_for(dict(os.environ, PROBE="yes"))
    for flags, run_env, served in (
        ([], env, True),
        (["-u"], dict(env, RANK="3"), True),
        ([], dict(env, TORCH_LOGS="+dynamo"), False),
        (["-B"], env, False),
    ):
        out = subprocess.run(
            [python, *flags, "preloaded.py"],
            cwd=tmp_path,
            env=run_env,
            capture_output=True,
            text=True,
        )
        assert out.stdout == f"{served}\n", (flags, out.stdout, out.stderr)
