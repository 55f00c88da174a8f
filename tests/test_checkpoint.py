"""Checkpoints one can trust and use: the manifest (every file's size and CRC-32, computed while writing, in place
before `latest` moves) checked on load, so a truncated or bit-rotted file stops the run with one message naming it
and the earlier checkpoint, touching nothing; old checkpoints without one still load; tools/check_checkpoint.py
finds missing, damaged, misshapen and drifted files offline; tools/sample.py reads a TP2 x PP2 checkpoint and
generates what one process generates from the same weights."""

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

import arguments
import checkpoint
import data
import parallel
import report
import reshard
from helpers import (  # noqa: F401
    ROOT,
    SMALL,
    assert_same,
    corpus,
    final_state,
    launch,
    log_fields,
    losses,
    run_cli,
    run_main,
    spawn,
    synthetic_corpus,
    write_checkpoint,
)
from model import GPT, GPTConfig
from sections import section

sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_checkpoint  # noqa: E402
import sample  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(corpus, tmp_path_factory):
    """global_step1 and global_step2 of the SMALL model; tests copy the directory before changing it."""
    directory = tmp_path_factory.mktemp("ckpt")
    run_main(
        *SMALL, "--train_iters=2", "--eval_iters=0", f"--save={directory}", "--save_interval=1"
    )
    return directory


def _contents(directory):
    """{relative path: sha256} of every file: what 'no checkpoint touched' compares."""
    out = {}
    for d, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(d, name)
            out[os.path.relpath(path, directory)] = hashlib.sha256(
                open(path, "rb").read()
            ).hexdigest()
    return out


def test_manifest_lists_every_file_with_its_size_and_crc(ckpt):
    tag_dir = os.path.join(ckpt, "global_step2")
    manifest = checkpoint.read_manifest(tag_dir)
    assert manifest["topology"] == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 1,
    }
    files = sorted(n for n in os.listdir(tag_dir) if n != checkpoint.MANIFEST)
    assert (
        sorted(manifest["files"])
        == files
        == ["mp_rank_00_000_model_states.pt", "rank_00000_optim_states.pt"]
    )
    for name, entry in manifest["files"].items():
        # computed here from the file, independently
        content = open(os.path.join(tag_dir, name), "rb").read()
        assert entry == {"bytes": len(content), "crc32": f"{zlib.crc32(content):08x}"}, name


def test_a_save_whose_manifest_fails_leaves_latest_where_it_was(corpus, tmp_path, monkeypatch):
    """The manifest is part of publishing: a failure writing it is a failed save, `latest` stays."""
    write_manifest, calls = checkpoint.write_manifest, []

    def fails_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return write_manifest(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_manifest", fails_second_time)
    with pytest.raises(
        ValueError, match="saving checkpoint .*global_step2 failed: .*Input/output error"
    ):
        run_main(
            *SMALL, "--train_iters=2", "--eval_iters=0", f"--save={tmp_path}", "--save_interval=1"
        )
    assert open(tmp_path / "latest").read().strip() == "global_step1"
    assert not [n for n in os.listdir(tmp_path) if n.startswith("global_step2")]


def test_truncated_file_stops_the_run_with_one_message_and_touches_nothing(ckpt, tmp_path):
    directory = shutil.copytree(ckpt, tmp_path / "run")
    path = directory / "global_step2" / "mp_rank_00_000_model_states.pt"
    path.write_bytes(path.read_bytes()[:-1000])  # a copy cut short
    before = _contents(directory)
    proc = run_cli(
        *SMALL, "--train_iters=4", f"--load={directory}", f"--save={directory}", expect_ok=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint file {path}: it is truncated"
    ), proc.stderr
    assert "Nothing was loaded; resume from global_step1 instead: echo global_step1 > " in errors[0]
    assert _contents(directory) == before


def test_flipped_byte_is_found_before_the_tensors_are_read(ckpt, tmp_path):
    directory = shutil.copytree(ckpt, tmp_path / "run")
    # the optimizer file, then the model file too (read first): each named in turn
    for name in ("rank_00000_optim_states.pt", "mp_rank_00_000_model_states.pt"):
        path = directory / "global_step2" / name
        content = bytearray(path.read_bytes())
        content[len(content) // 2] ^= 0x04  # one bit, inside a tensor's bytes
        path.write_bytes(bytes(content))
        # torch reads it without a word: only the checksum can tell
        torch.load(path, weights_only=False)
        with pytest.raises(
            ValueError,
            match=rf"{name}: its CRC-32 is [0-9a-f]{{8}} where the manifest says "
            r"[0-9a-f]{8}: it is corrupt .* resume from global_step1",
        ):
            checkpoint.load(str(directory / "global_step2"))
    with pytest.raises(ValueError, match="mp_rank_00_000_model_states.pt: its CRC-32 is"):
        sample.load_model(str(directory), "cpu")


def test_checkpoint_without_a_manifest_loads_with_one_note(ckpt, tmp_path, capsys, monkeypatch):
    directory = shutil.copytree(ckpt, tmp_path / "old")
    for tag in ("global_step1", "global_step2"):
        os.remove(directory / tag / checkpoint.MANIFEST)
    monkeypatch.setattr(checkpoint, "warned_no_manifest", False)
    assert checkpoint.saved_topology(str(directory / "global_step2"))["data_parallel_size"] == 1
    model, run, rank = checkpoint.load(str(directory / "global_step2"))
    checkpoint.load(str(directory / "global_step1"))
    assert run["state"]["iteration"] == 2 and "optimizer" in rank
    assert capsys.readouterr().out.count("has no manifest.json (written by an older version)") == 1
    assert check_checkpoint.main([str(directory)]) == 0


def test_a_checkpoint_of_another_format_is_refused_by_name(ckpt, tmp_path):
    """A manifest of a format this code does not read (a later version's) is refused before a tensor
    is read, not read as this version's files."""
    directory = shutil.copytree(ckpt, tmp_path / "later")
    path = directory / "global_step2" / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": 2}))
    with pytest.raises(ValueError, match=r"global_step2 is in format 2 .* \(format 1\): resume it"):
        checkpoint.load(str(directory / "global_step2"))


# -----------------------------------------------------------------------------
# async_save: written by a background thread, published as a synchronous save is


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """(losses, final checkpoint's directory) of 3 iterations uninterrupted, saved synchronously at the end."""
    directory = tmp_path_factory.mktemp("straight")
    return losses(
        run_main(*SMALL, "--eval_iters=0", "--train_iters=3", f"--save={directory}")
    ), directory


def assert_same_end(straight, directory):
    (tag_a, model_a, rank_a), (tag_b, model_b, rank_b) = (
        final_state(straight[1]),
        final_state(directory),
    )
    assert tag_a == tag_b == "global_step3"
    assert_same(model_a["model"], model_b["model"], "model")
    assert_same(rank_a["optimizer"], rank_b["optimizer"], "optimizer")


def test_async_save_writes_what_a_save_writes_and_resumes_bit_exactly(ckpt, straight, tmp_path):
    """The background thread writes, from its host copy, the tensors a synchronous save writes at the same
    iteration (the training went on meanwhile: a copy that aliased the live weights would differ); a run resumed
    from it follows an uninterrupted one bit for bit."""
    directory = tmp_path / "async"
    args = [*SMALL, "--eval_iters=0", f"--save={directory}", "--async_save"]
    out = run_main(*args, "--train_iters=2", "--save_interval=1")
    assert "saving checkpoint in the background at iteration        1" in out
    for tag in ("global_step1", "global_step2"):
        (model_a, run_a, rank_a), (model_b, run_b, rank_b) = (
            checkpoint.load(str(d / tag)) for d in (ckpt, directory)
        )
        assert_same(model_a, model_b, f"{tag} model")
        assert_same(rank_a["optimizer"], rank_b["optimizer"], f"{tag} optimizer")
        assert run_a["state"] == run_b["state"]
        assert check_checkpoint.main([str(directory / tag)]) == 0
    assert losses(run_main(*args, "--train_iters=3")) == {3: straight[0][3]}
    assert_same_end(straight, directory)


@pytest.mark.slow
def test_async_save_on_two_ranks_writes_what_a_save_writes(synthetic_corpus, tmp_path):
    """TP=2 under torchrun: the writer threads' barriers run on their own gloo group beside the training's
    collectives; every file of each checkpoint holds what a synchronous run's holds."""
    args = [
        f"--data_path={synthetic_corpus}",
        "--tensor_model_parallel_size=2",
        "--train_iters=4",
        "--save_interval=2",
    ]
    sync = launch(tmp_path, 2, *args, f"--save={tmp_path / 'sync'}")
    background = launch(tmp_path, 2, *args, f"--save={tmp_path / 'async'}", "--async_save")
    assert (
        background.lines == sync.lines and "saving checkpoint in the background" in background.out
    )
    for tag in ("global_step2", "global_step4"):
        names = sorted(checkpoint.read_manifest(str(tmp_path / "sync" / tag))["files"])
        assert sorted(checkpoint.read_manifest(str(tmp_path / "async" / tag))["files"]) == names
        for name in names:
            a, b = (
                torch.load(tmp_path / d / tag / name, weights_only=False) for d in ("sync", "async")
            )
            assert_same(
                a.get("model", a.get("optimizer")),
                b.get("model", b.get("optimizer")),
                f"{tag}/{name}",
            )
    assert check_checkpoint.main([str(tmp_path / "async")]) == 0


# A run whose background write of global_step2 stops half-way through its first file (until killed), while its
# training goes on; torch.save is the one checkpoint.py calls, so nothing else changes.
KILLED_MID_WRITE = """
import io, os, runpy, sys, time, torch
marker, real_save = sys.argv[1], torch.save
def save(obj, f, *args, **kwargs):
    if "global_step2" in getattr(getattr(f, "f", None), "name", ""):
        data = io.BytesIO()
        real_save(obj, data, *args, **kwargs)
        f.write(data.getvalue()[:len(data.getvalue()) // 2])
        f.flush()
        open(marker, "w").close()
        time.sleep(600)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
runpy.run_path("train.py", run_name="train_script")["main"](sys.argv[2:])
"""


@pytest.mark.slow
def test_kill_during_a_background_write_leaves_the_previous_checkpoint(straight, tmp_path):
    """kill -9 while global_step2 is half written: `latest` still names global_step1, which is whole, and the
    run resumed from it (the stale lock taken over, the debris removed) ends as an uninterrupted run does."""
    directory, marker = tmp_path / "run", tmp_path / "writing"
    args = [
        *SMALL,
        "--eval_iters=0",
        "--train_iters=3",
        f"--save={directory}",
        "--save_interval=1",
        "--async_save",
    ]
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(marker), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), (
            proc.communicate(timeout=60)[0][-3000:] if proc.poll() is not None else "timeout"
        )
        time.sleep(1.0)  # the loop goes on beside the write: iteration 3 runs
        os.kill(proc.pid, signal.SIGKILL)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert "saving checkpoint in the background at iteration        2" in out
    assert open(directory / "latest").read().strip() == "global_step1"
    assert not (directory / "global_step2").exists()
    partial = directory / "global_step2.partial"
    assert [n for n in os.listdir(partial) if n.endswith(".tmp")] and not (
        partial / checkpoint.MANIFEST
    ).exists()
    assert check_checkpoint.main([str(directory)]) == 0  # global_step1, the one `latest` names
    resumed = run_main(*args)
    assert "resuming from" in resumed and "taking over the lock" in resumed
    assert losses(resumed) == {i: straight[0][i] for i in (2, 3)}
    assert_same_end(straight, directory)
    assert sorted(n for n in os.listdir(directory) if n.startswith("global_step")) == [
        "global_step1",
        "global_step2",
        "global_step3",
    ]


# -----------------------------------------------------------------------------
# tools/check_checkpoint.py, and a TP2 x PP2 checkpoint


TP2PP2 = [
    "--num_layers=4",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--vocab_size=50257",
    "--embed_layernorm=false",
    "--activation=gelu_tanh",
    "--tensor_model_parallel_size=2",
    # large weights: greedy text that varies
    "--pipeline_model_parallel_size=2",
    "--init_method_std=1.0",
]


@torch.no_grad()
def weights(stage):
    """The same weights in any layout: GPT.init_weights draws every full tensor by name and keeps this rank's
    slice; the LayerNorms and biases are then moved away from ones and zeros, drawn the same way."""
    stage.init_weights(seed=7)
    for name, p in stage.named_parameters():
        if p.ndim == 1:
            tp_dim = getattr(p, "tp_dim", None)
            full = torch.randn(
                p.shape[0] * (stage.grid.tp_size if tp_dim is not None else 1),
                generator=torch.Generator().manual_seed(zlib.crc32(name.encode())),
            )
            p.add_(parallel.shard(full, tp_dim, stage.grid))


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """A TP=2 x PP=2 checkpoint of a 4-layer model with GPT-2's vocabulary (50257, padded to 50432 for TP=2),
    written rank by rank from this process."""
    directory = tmp_path_factory.mktemp("tp2pp2")
    write_checkpoint(str(directory), TP2PP2, weights)
    return directory


def test_check_tool_passes_whole_checkpoints(ckpt, tp2pp2, capsys):
    assert check_checkpoint.main([str(tp2pp2)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "TP=2 x PP=2 x DP=1, 8 files whole" in out, out
    assert check_checkpoint.main([str(ckpt / "global_step1")]) == 0


def test_check_tool_passes_an_untied_output_layer_on_the_last_stage(tmp_path):
    """An untied output layer (Llama's) is the last stage's own parameter: no copy of the embedding to compare
    (it was a KeyError traceback on 'output_weight')."""
    write_checkpoint(
        str(tmp_path),
        [*TP2PP2, "--tensor_model_parallel_size=1", "--untie_embeddings_and_output_weights"],
        weights,
    )
    problems, summary = check_checkpoint.check(str(tmp_path))
    assert problems == [] and "TP=1 x PP=2 x DP=1, 4 files whole" in summary


def run_tool(directory):
    import subprocess

    return subprocess.run(
        [sys.executable, "tools/check_checkpoint.py", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_check_tool_finds_damaged_and_drifted_files(tp2pp2, tmp_path, capsys):
    directory = shutil.copytree(tp2pp2, tmp_path / "bad")
    tag_dir = directory / "global_step1"
    shard = tag_dir / "mp_rank_01_001_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    os.remove(tag_dir / "rank_00002_optim_states.pt")
    proc = run_tool(directory)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL {shard}: it is truncated or overwritten" in proc.stdout
    assert f"FAIL {tag_dir / 'rank_00002_optim_states.pt'}: it is missing" in proc.stdout

    # Whole files whose contents are wrong, each rewritten with a manifest that matches: a LayerNorm drifted on
    # TP rank 1 (lesson 18); on the last stage, a parameter gone and one of another shape.
    directory = shutil.copytree(tp2pp2, tmp_path / "wrong")
    tag_dir = str(directory / "global_step1")
    files = checkpoint.read_manifest(tag_dir)["files"]
    for rank, change in (
        (1, lambda m: m["blocks.0.ln_1.weight"][3].add_(1e-3)),
        (2, lambda m: (m.pop("ln_f.bias"), m.update({"blocks.3.mlp.fc1.weight": torch.zeros(3)}))),
    ):
        g = parallel.Grid(2, 2, world_size=4, rank=rank)
        blob = torch.load(checkpoint.model_file(tag_dir, g), weights_only=False)
        change(blob["model"])
        files.update(
            checkpoint.write_files(tag_dir, blob["model"], blob["run"], {"optimizer": {}}, True, g)
        )
    checkpoint.write_manifest(tag_dir, [files], g)
    assert check_checkpoint.main([str(directory)]) == 1
    out = capsys.readouterr().out
    assert (
        "mp_rank_01_000_model_states.pt: blocks.0.ln_1.weight differs from TP rank 0's copy" in out
    ), out
    assert "mp_rank_00_001_model_states.pt: ln_f.bias is missing" in out
    assert (
        "mp_rank_00_001_model_states.pt: blocks.3.mlp.fc1.weight has shape (3,), the stored config's model "
        "(64, 32)" in out
    )
    assert out.count("FAIL") == 3


def test_sample_reads_a_tp2_pp2_checkpoint(tp2pp2, capsys):
    """Greedy text from the TP2 x PP2 files (gathered into one process by reshard.py) is the text of the same
    weights in one process."""
    sample.main(["--load", str(tp2pp2), "--prompt", "ROMEO:", "--max_tokens", "12", "--top_k", "1"])
    text = capsys.readouterr().out.rstrip("\n")
    cfg = arguments.load_config(
        [*TP2PP2, "--tensor_model_parallel_size=1", "--pipeline_model_parallel_size=1"]
    )
    one = GPT(section(GPTConfig, cfg)).eval()
    weights(one)
    tok = data.get_tokenizer()
    out = one.generate(torch.tensor([tok.encode_ordinary("ROMEO:")]), 12, top_k=1)
    assert text == tok.decode(out[0].tolist())
    assert len(set(out[0, 3:].tolist())) >= 4, "a degenerate model would not tell layouts apart"
    gathered, _, _ = reshard.load_full_model(str(tp2pp2))
    assert all(
        torch.equal(p, dict(one.named_parameters())[n][: p.shape[0]])
        for n, p in gathered.named_parameters()
    )


# -- async save under a forced interleaving: the writer held until the next step and the next save have run --


def _state(value):
    """A rank's checkpoint state at one step: weights, Adam moments, the run state, the RNG."""
    g = torch.Generator().manual_seed(int(value))
    model_state = {"w": torch.randn(64, 32, generator=g), "b": torch.full((32,), float(value))}
    return (
        model_state,
        {"state": {"iteration": int(value)}},
        {"adam": torch.randn(64, 32, generator=g)},
    )


def _files(directory):
    return {
        os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
        for d, _, names in os.walk(directory)
        for f in names
    }


def test_async_save_held_until_the_next_step_and_save_writes_what_a_synchronous_save_writes(
    tmp_path, monkeypatch
):
    """The background write of checkpoint 1 is held until the training has changed the live tensors (the next
    optimizer step) and started the next save (its host copy made, or it waiting for the first): checkpoint 1's
    files must still be byte for byte a synchronous save's of step 1's state. Fails if a save does not wait for
    the one in flight (the next copy overwrites the held payload's buffers) or if the payload is written from
    the live tensors instead of its host copy. Not timing: an event orders the threads."""
    import threading

    release, held = threading.Event(), threading.Event()
    real_save, real_copy, real_wait = (
        checkpoint.save,
        checkpoint.host_copy,
        checkpoint.AsyncWriter.wait,
    )

    def held_save(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and not held.is_set():
            held.set()
            release.wait()  # the first background write waits for the main thread to move on
        return real_save(*args, **kwargs)

    def copy_then_release(*args, **kwargs):
        out = real_copy(*args, **kwargs)
        if held.is_set():
            release.set()  # the next save's copy is made: now let the held write go
        return out

    def wait_releases(self):
        release.set()  # a save that waits for the one in flight must let it finish first
        return real_wait(self)

    monkeypatch.setattr(checkpoint, "save", held_save)
    monkeypatch.setattr(checkpoint, "host_copy", copy_then_release)
    monkeypatch.setattr(checkpoint.AsyncWriter, "wait", wait_releases)

    model_state, run, rank = _state(1)
    expected = {}
    real_save(str(tmp_path / "sync"), 1, *_state(1), write_model_state=True)
    expected[1] = _files(tmp_path / "sync" / "global_step1")
    with checkpoint.AsyncWriter() as writer:
        writer.save(str(tmp_path / "async"), 1, model_state, run, rank, write_model_state=True)
        # the next optimizer step, in place
        for live, new in zip((model_state, rank), _state(2)[::2]):
            for key in live:
                live[key].copy_(new[key])
        run["state"]["iteration"] = 2
        writer.save(str(tmp_path / "async"), 2, model_state, run, rank, write_model_state=True)
    real_save(str(tmp_path / "sync"), 2, *_state(2), write_model_state=True)
    expected[2] = _files(tmp_path / "sync" / "global_step2")
    for iteration in (1, 2):
        written = _files(tmp_path / "async" / f"global_step{iteration}")
        assert written.keys() == expected[iteration].keys()
        for name in written:
            assert written[name] == expected[iteration][name], (iteration, name)


class _Killed(BaseException):
    """A kill -9 at that line: no handler of the save runs."""


def _stop_at_the_second_rename(monkeypatch, exc):
    """os.replace raises exc when it would move a save's partial directory into place."""
    replace = os.replace

    def stopped(src, dst):
        if str(src).endswith(checkpoint.PARTIAL):
            raise exc
        return replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", stopped)


def test_a_new_save_of_the_latest_iteration_never_leaves_latest_on_a_deleted_checkpoint(
    tmp_path, monkeypatch
):
    """A rollback saves the iteration `latest` names again. It deleted the old copy before moving the new one
    in: a kill in between left `latest` on a missing (or, killed inside the rmtree, half-deleted) directory.
    Now the old copy is renamed aside and deleted last; a kill between the two renames is named with the fix,
    a failure there puts the old copy back."""
    directory = tmp_path / "run"
    checkpoint.save(str(directory), 2, *_state(1), write_model_state=True)
    before = _files(directory / "global_step2")
    with monkeypatch.context() as m:
        _stop_at_the_second_rename(m, OSError(5, "Input/output error"))
        with pytest.raises(ValueError, match="saving checkpoint .*global_step2 failed"):
            checkpoint.save(str(directory), 2, *_state(2), write_model_state=True)
    assert sorted(os.listdir(directory)) == ["global_step2", "latest"]
    assert _files(directory / "global_step2") == before
    with monkeypatch.context() as m:
        _stop_at_the_second_rename(m, _Killed())
        with pytest.raises(_Killed):
            checkpoint.save(str(directory), 2, *_state(2), write_model_state=True)
    step = directory / "global_step2"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"a save replacing {step} was killed between its two renames: global_step2.partial is the new "
            f"checkpoint (whole: its manifest is written) and global_step2.replaced the one it replaced; resume "
            f"from either by renaming it: mv {step}.partial {step} (or mv {step}.replaced {step})"
        ),
    ):
        checkpoint.latest_dir(str(directory))
    assert _files(directory / "global_step2.replaced") == before
    os.rename(f"{step}.partial", step)  # the fix the message gives
    for name in os.listdir(step):
        if name != checkpoint.MANIFEST:
            checkpoint.verify(str(step / name))
    assert _files(step) != before
    # the next save of that iteration removes the set-aside copy, once it is no longer needed
    checkpoint.save(str(directory), 2, *_state(2), write_model_state=True)
    assert sorted(os.listdir(directory)) == ["global_step2", "latest"]


def test_a_rollback_by_latest_says_which_checkpoints_it_will_replace(ckpt, tmp_path):
    """Lesson 9's rollback (edit `latest`, run again) replaced the abandoned timeline's checkpoints with nothing
    said. They are not this run's: named at the start."""
    directory = shutil.copytree(ckpt, tmp_path / "run")
    (directory / "latest").write_text("global_step1\n")
    out = run_main(*SMALL, "--train_iters=2", "--eval_iters=0", f"--save={directory}")
    assert (
        f"global_step2 in {directory} (after global_step1: the timeline this resume leaves) will each be "
        "replaced if this run saves its iteration; copy them elsewhere to keep them"
    ) in out
    assert checkpoint.later(str(directory / "global_step1")) == ["global_step2"]
    assert "will each be replaced" not in run_main(
        *SMALL, "--train_iters=3", "--eval_iters=0", f"--save={directory}"
    )


def test_a_rollback_by_latest_leaves_the_abandoned_iterations_out_of_the_metrics_and_tensorboard(
    corpus, tmp_path
):
    """Lesson 9's rollback, run to an iteration short of the abandoned timeline's last: metrics.jsonl's readers
    (tools/plot.py, tools/precursors.py, the lab) took that timeline's later iterations for the run's, and
    TensorBoard showed both timelines' points of every iteration the run had run again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = (*SMALL, "--eval_iters=0", f"--save={tmp_path}", "--save_interval=2")
    run_main(*args, "--train_iters=4")
    (tmp_path / "latest").write_text("global_step2\n")
    out = run_main(*args, "--train_iters=3")  # iteration 3 again; 4 abandoned
    records = report.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert sorted(records) == [1, 2, 3]
    assert f"{records[3]['lm loss']:.6E}" == log_fields(out)[3]["lm loss"]
    for axis, tag, steps in (
        ("", "lm-loss", [1, 2, 3]),
        ("samples", "lm-loss vs samples", [8, 16, 24]),
        ("tokens", "lm-loss vs tokens", [512, 1024, 1536]),
    ):
        events = EventAccumulator(str(tmp_path / "tensorboard" / axis))
        events.Reload()
        assert [e.step for e in events.Scalars(tag)] == steps, axis


@pytest.mark.parametrize("tag", ["", "/etc", ".."])
def test_a_latest_that_names_no_checkpoint_directory_is_refused(tmp_path, tag):
    """An empty `latest` named the save directory itself: "model shard is missing ... another topology"."""
    (tmp_path / "latest").write_text(tag + "\n")
    with pytest.raises(
        ValueError, match="which names no checkpoint: write the tag of a complete checkpoint"
    ):
        checkpoint.latest_dir(str(tmp_path))


def _checkpoint_writes_talk_on_the_host_group(directory):
    """On each of 2 ranks: every collective of a checkpoint write is on parallel.host_group(), made once with
    backend="gloo" and the host work's timeout (under NCCL the default group's backend: a barrier of the writer's
    thread there would queue beside the training's collectives on the GPU, and a slow disk would trip the
    training's shorter timeout), never on the default group. A background write issues none from the main thread;
    a synchronous one (async_save off) waits on the same group."""
    import datetime
    import threading

    import torch.distributed as dist

    calls, made, real_new_group = [], [], dist.new_group
    wrapped = {
        name: getattr(dist, name) for name in ("all_gather", "all_reduce", "barrier", "broadcast")
    }

    def recording(name):
        def call(*args, **kwargs):
            calls.append(
                (threading.current_thread() is threading.main_thread(), name, kwargs.get("group"))
            )
            return wrapped[name](*args, **kwargs)

        return call

    def new_group(*args, **kwargs):
        made.append((kwargs.get("backend"), kwargs.get("timeout")))
        return real_new_group(*args, **kwargs)

    try:
        dist.new_group = new_group
        for name in wrapped:
            setattr(dist, name, recording(name))
        for enabled in (True, False):
            with checkpoint.AsyncWriter(enabled) as writer:
                for iteration in (1, 2):
                    writer.save(
                        f"{directory}/{enabled}",
                        iteration,
                        *_state(iteration),
                        write_model_state=parallel.grid.rank == 0,
                    )
            if enabled:
                background, calls[:] = list(calls), []
    finally:
        dist.new_group = real_new_group
        for name, original in wrapped.items():
            setattr(dist, name, original)
    group = parallel.host_group()
    assert made == [("gloo", datetime.timedelta(minutes=parallel.host_timeout))], made
    assert dist.get_backend(group) == "gloo" and group is not dist.group.WORLD
    assert background and all(not main and g is group for main, _, g in background), background
    assert calls and all(main and g is group for main, _, g in calls), calls


def test_checkpoint_writes_talk_on_the_host_group(tmp_path):
    spawn(_checkpoint_writes_talk_on_the_host_group, 2, 1, 1, str(tmp_path))


def test_a_weight_dump_cut_short_leaves_no_dump_under_its_name(tmp_path, monkeypatch):
    """dump_weights wrote its file in place: a kill mid-write left a dump cut short under the name
    tools/compare_weight_dumps.py reads."""
    monkeypatch.setattr(parallel, "grid", parallel.Grid(1, 1, world_size=1, rank=0))
    model = torch.nn.Linear(2, 2)
    real_save = torch.save

    def killed(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        if hasattr(f, "write"):
            f.write(data[: len(data) // 2])
        else:
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
        raise KeyboardInterrupt  # the kill, half-way through the bytes

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.dump_weights(str(tmp_path), "before-save", 5, model)
    monkeypatch.setattr(torch, "save", real_save)
    assert [n for n in os.listdir(tmp_path / "weight_dumps") if n.endswith(".pt")] == []
    checkpoint.dump_weights(str(tmp_path), "before-save", 5, model)
    (name,) = [n for n in os.listdir(tmp_path / "weight_dumps") if n.endswith(".pt")]
    assert torch.equal(torch.load(tmp_path / "weight_dumps" / name)["weight"], model.weight)
