"""The README's "The core: one step" table names exactly the files one iteration runs (traced)."""

import json
import os
import re
import subprocess
import sys

from helpers import corpus  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs train.py's main with a profiler on every thread (the prefetcher's too) recording the
# project files whose functions run, or call, from the 2nd train_step call to the 3rd: one whole
# iteration (the step, the log line, the checks after it, the next batch, its LR), set-up excluded.
TRACE = """
import json, os, runpy, sys, threading
root = os.getcwd() + os.sep
seen, calls = set(), [0]
def profile(frame, event, arg):
    if event != "call":
        return
    path = frame.f_code.co_filename
    if path.endswith(os.sep + "training.py") and frame.f_code.co_name == "train_step":
        calls[0] += 1
    while calls[0] == 2 and frame is not None:  # the function and its callers: the loop's file too
        file = os.path.abspath(frame.f_code.co_filename)  # run_path's train.py is relative
        if file.startswith(root) and os.path.isfile(file):  # not a dataclass's generated <string>
            seen.add(os.path.relpath(file, root))
        frame = frame.f_back
threading.setprofile(profile)
sys.setprofile(profile)
runpy.run_path("train.py", run_name="train_script")["main"](sys.argv[1:])
sys.setprofile(None)
threading.setprofile(None)
print("TRACED " + json.dumps(sorted(seen)))
"""


def _traced_files(*args):
    out = subprocess.run(
        [sys.executable, "-c", TRACE, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("TRACED ")]
    return set(json.loads(line[len("TRACED ") :]))


def _readme_one_step_files():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("**The core: one step.**", 1)[1].split(
        "**The core: around the step.**", 1
    )[0]
    return set(re.findall(r"^\| `([^`]+\.py)` \|", section, re.M))


def test_the_readme_names_exactly_the_files_one_iteration_runs(corpus):
    traced = _traced_files(
        "--num_layers=1",
        "--hidden_size=32",
        "--num_attention_heads=2",
        "--seq_length=16",
        "--micro_batch_size=2",
        "--global_batch_size=2",
        "--train_iters=6",
        "--eval_iters=0",
        "--log_interval=1",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
        f"--data_path={corpus}",
    )
    assert "training.py" in traced and "model.py" in traced, traced  # the trace saw the step
    assert not any(path.startswith("stability") for path in traced), traced
    assert _readme_one_step_files() == traced, (
        f"README lists {sorted(_readme_one_step_files())}, one iteration runs {sorted(traced)}"
    )
