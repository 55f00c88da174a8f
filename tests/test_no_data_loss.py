"""Nothing a user types deletes their work: tools/export_hf.py writes into OUTPUT.partial and
renames it into place once its logits are checked, refuses an --output it did not write (the
checkpoint itself, a directory holding it, `.`, a run's save directory, anything not empty),
replaces an earlier export of its own only with --overwrite, and a SIGTERM or a kill -9 leaves
nothing loadable at --output. A global_stepN.partial (a killed save or import) is named as such by
the tools that meet it, never counted as a checkpoint. tools/evaluate.py refuses an --output_path it
could not write before the evaluation."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import checkpoint
import eval_harness
from helpers import ROOT, SMALL, TINY_GPT2, run_main, write_checkpoint

sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_checkpoint  # noqa: E402
import evaluate as evaluate_tool  # noqa: E402
import export_hf  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A run's save directory: global_step1 of a tiny GPT2LMHeadModel-shaped model, `latest`, a
    metrics file."""
    directory = tmp_path_factory.mktemp("run") / "ck"
    write_checkpoint(str(directory), TINY_GPT2, lambda stage: None)
    (directory / "metrics.jsonl").write_text('{"iteration": 1}\n')
    return directory


def contents(directory):
    """{relative path: sha256} of every file under directory: what a refused export must leave as it
    was."""
    found = {}
    for d, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(d, name)
            found[os.path.relpath(path, directory)] = hashlib.sha256(
                open(path, "rb").read()
            ).hexdigest()
    return found


def refused(argv, capsys):
    """export_hf's command on argv: its exit status must be 2, its stderr one line; returns it."""
    assert export_hf.run(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_export_into_its_own_checkpoint_is_refused_and_the_checkpoint_stays(
    ckpt, capsys, monkeypatch
):
    """It was: exit 0 after deleting global_step*/, latest and metrics.jsonl, the export in their
    place. An --output inside one of its global_stepN was written, and deleted by the next save of
    that iteration (a folder of the save directory beside them is no save's: tests/test_export_hf.py)."""
    before = contents(ckpt.parent)
    for output, overwrite, message in (
        (ckpt, [], f"--output {ckpt} is the checkpoint directory --load"),
        (ckpt, ["--overwrite"], f"--output {ckpt} is the checkpoint directory --load"),
        (
            ckpt.parent,
            ["--overwrite"],
            f"--output {ckpt.parent} holds the checkpoint directory --load",
        ),
        (
            ckpt / "global_step1" / "hf",
            [],
            f"--output {ckpt}/global_step1/hf is inside the checkpoint global_step1 of --load ({ckpt}): "
            f"a later save of that iteration deletes it; give a directory outside it, e.g. --output "
            f"{ckpt}/hf",
        ),
        (ckpt / "global_step1", ["--overwrite"], "is inside the checkpoint global_step1 of --load"),
    ):
        line = refused(["--load", str(ckpt), "--output", str(output), *overwrite], capsys)
        assert line.startswith("error: ") and message in line, line
    monkeypatch.chdir(ckpt / "global_step1")
    line = refused(["--load", str(ckpt), "--output", ".", "--overwrite"], capsys)
    assert "--output . is the working directory" in line and "holds the checkpoint" not in line
    monkeypatch.chdir(ckpt.parent)
    line = refused(["--load", "ck", "--output", ".", "--overwrite"], capsys)
    assert line == (
        f"error: --output . holds the checkpoint directory --load ({ckpt}): an export never writes "
        "there; give a new directory, e.g. --output ck-hf"
    )
    assert contents(ckpt.parent) == before


def test_an_output_the_export_did_not_write_is_refused_overwrite_or_not(ckpt, tmp_path, capsys):
    other_run = tmp_path / "other"  # another run's save directory
    write_checkpoint(str(other_run), TINY_GPT2, lambda stage: None)
    mine = tmp_path / "mine"  # a directory of anything else
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    line = refused(["--load", str(ckpt), "--output", str(a_file / "hf")], capsys)
    assert (
        line == f"error: --output {a_file / 'hf'} cannot be written: {a_file} is a file; give "
        "another directory"
    )
    before = contents(tmp_path)
    for output, message in (
        (other_run, "holds a checkpoint or a run's save directory (global_step1, latest)"),
        (mine, "is not empty (notes.txt) and is not an export of ours"),
        (a_file, "is a file"),
    ):
        for overwrite in ([], ["--overwrite"]):
            line = refused(["--load", str(ckpt), "--output", str(output), *overwrite], capsys)
            assert f"--output {output} {message}" in line, line
    assert contents(tmp_path) == before


def test_an_output_that_is_a_symbolic_link_is_refused_before_the_export(
    ckpt, tmp_path, capsys, monkeypatch
):
    """It was accepted (an empty directory behind it) and failed after the whole export, at publish's
    rmdir of the link."""

    def loaded(*args):
        raise AssertionError("the checkpoint was read before --output was checked")

    monkeypatch.setattr(export_hf.reshard, "load_full_model", loaded)
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "nowhere"):  # an empty directory; a dangling link
        link = tmp_path / f"link-{target.name}"
        link.symlink_to(target)
        for overwrite in ([], ["--overwrite"]):
            line = refused(["--load", str(ckpt), "--output", str(link), *overwrite], capsys)
            assert line == (
                f"error: --output {link} is a symbolic link (to {target}); give the directory itself "
                f"(--output {os.path.realpath(link)}) or a new directory"
            ), line
    assert sorted(os.listdir(tmp_path)) == ["empty", "link-empty", "link-nowhere"]
    assert os.listdir(empty) == []


def test_an_earlier_export_is_replaced_with_overwrite_only(ckpt, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export_hf.run(["--load", str(ckpt), "--output", str(out)]) == 0
    marker = json.load(open(out / export_hf.MARKER))
    assert marker["files"] == sorted(os.listdir(out)) and "model.safetensors" in marker["files"]
    assert not os.path.exists(f"{out}.partial")
    first = contents(out)
    capsys.readouterr()
    assert "holds an earlier export" in refused(["--load", str(ckpt), "--output", str(out)], capsys)
    (out / "README.md").write_text("my model card")  # the user's own file in the export
    line = refused(["--load", str(ckpt), "--output", str(out), "--overwrite"], capsys)
    assert "holds an earlier export and files it did not write (README.md)" in line
    assert contents(out) == {**first, "README.md": contents(out)["README.md"]}
    os.remove(out / "README.md")
    assert export_hf.run(["--load", str(ckpt), "--output", str(out), "--overwrite"]) == 0
    assert "export complete" in capsys.readouterr().out and sorted(os.listdir(out)) == sorted(first)


def _whole(directory, first):
    """Is directory a whole export: every file of the export first (contents), byte for byte (the
    marker aside: it says when)?"""
    found = contents(directory) if os.path.isdir(directory) else {}
    return all(found.get(name) == h for name, h in first.items() if name != export_hf.MARKER)


def test_an_overwrite_stopped_or_killed_in_its_publish_leaves_a_whole_export(
    ckpt, tmp_path, capsys, monkeypatch
):
    """It was: publish deleted the earlier export, then renamed the new one into place; a SIGTERM
    between the two removed the new one too, a kill -9 left the only whole export in OUTPUT.partial,
    which the next export deletes. At each moment of publish (each rename, before and after, and
    each file of the earlier export deleted) a whole export is at OUTPUT or OUTPUT.replaced; a
    SIGTERM sent there waits for publish; the next export finishes what a kill -9 there left."""
    out = tmp_path / "hf"
    assert export_hf.run(["--load", str(ckpt), "--output", str(out)]) == 0
    first = contents(out)
    real_replace, real_remove = os.replace, os.remove
    aside = f"{out}{export_hf.REPLACED}"
    moments = []

    def moment():
        """Check the invariant, copy what a kill -9 now would leave, send a SIGTERM."""
        assert _whole(out, first) or _whole(aside, first), os.listdir(tmp_path)
        copy = tmp_path / f"killed-{len(moments)}"
        for name in os.listdir(tmp_path):
            if name.startswith("hf"):
                shutil.copytree(tmp_path / name, copy / name)
        moments.append(copy)
        signal.raise_signal(signal.SIGTERM)

    def replace(src, dst):
        publishing = str(dst) in (str(out), aside)  # not a file's rename inside an export
        if publishing:
            moment()
        real_replace(src, dst)
        if publishing:
            moment()

    def remove(path):
        real_remove(path)
        if str(path).startswith(aside):
            moment()

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "remove", remove)
    status = export_hf.run(["--load", str(ckpt), "--output", str(out), "--overwrite"])
    monkeypatch.undo()
    assert status == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: SIGTERM: it came while the export was being renamed into place, which was let "
        f"finish: the export is complete at {out}"
    )
    assert len(moments) >= 5 and _whole(out, first)
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", *(m.name for m in moments)])
    for copy in moments:
        left = sorted(os.listdir(copy))
        assert (
            export_hf.run(["--load", str(ckpt), "--output", str(copy / "hf"), "--overwrite"]) == 0
        )
        said = capsys.readouterr().out
        if "hf" not in left:  # killed between the renames: the earlier export is put back
            assert f"restoring {copy / 'hf'} from {copy / 'hf'}.replaced: " in said, left
        elif "hf.replaced" in left:  # killed after them: the earlier export's rest is deleted
            assert f"removing {copy / 'hf'}.replaced: the earlier export" in said, left
        assert os.listdir(copy) == ["hf"] and _whole(copy / "hf", first)
    # a copy of an export the user made under that name is not ours: never deleted
    shutil.copytree(out, aside)
    kept = contents(aside)
    line = refused(["--load", str(ckpt), "--output", str(out), "--overwrite"], capsys)
    assert line == (
        f"error: {aside} exists: it is where --overwrite sets the earlier export aside until the "
        "new one is in place; move it away or give another --output"
    )
    shutil.rmtree(out)
    assert export_hf.run(["--load", str(ckpt), "--output", str(out)]) == 0
    assert contents(aside) == kept and _whole(out, first)


def test_a_failed_write_names_the_flag_and_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"

    def full_disk(gpt, output, *args):
        (tmp_path / "hf.partial" / "config.json").write_text("{}")  # half of what it writes
        raise OSError(28, "No space left on device", f"{tmp_path}/hf.partial/model.safetensors")

    monkeypatch.setattr(export_hf, "save", full_disk)
    line = refused(["--load", str(ckpt), "--output", str(out)], capsys)
    assert line == (
        f"error: --output {out}: the export could not be written (No space left on device: "
        f"{out}.partial/model.safetensors); {out}.partial removed, nothing written at {out}"
    )
    assert os.listdir(tmp_path) == []


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_partial_export_is_removed_when_ours_and_named_when_not(ckpt, tmp_path, capsys):
    out = tmp_path / "hf"
    partial = tmp_path / "hf.partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    line = refused(["--load", str(ckpt), "--output", str(out)], capsys)
    assert line == (
        f"error: {partial} exists and is not a half-finished export of ours (no "
        f"{export_hf.MARKER}); it is where this export writes before renaming into --output: move "
        "it away or give another --output"
    )
    assert os.listdir(partial) == ["config.json"]
    export_hf.write_marker(
        partial,
        {
            "written_by": "tools/export_hf.py",
            "pid": _dead_pid(),
            "host": __import__("socket").gethostname(),
        },
    )
    assert export_hf.run(["--load", str(ckpt), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert (
        f"removing {partial}: a half-finished export, left by an export (pid" in said
        and "killed" in said
    )
    assert not partial.exists() and (out / "model.safetensors").exists()


def test_a_half_finished_checkpoint_is_named_and_never_exported_or_resumed(ckpt, tmp_path, capsys):
    """A killed import left global_step1.partial: the export counted it as a checkpoint, train.py
    said to write a tag into `latest`."""
    directory = tmp_path / "killed"
    (directory / "global_step1.partial").mkdir(parents=True)
    message = (
        f"{directory} holds no checkpoint: global_step1.partial is a checkpoint whose writing was "
        "killed before it completed (a save or an import that did not finish): nothing in it can "
        "be resumed or exported; delete it "
        f"(rm -r {directory / 'global_step1.partial'}) and save or import again"
    )
    assert (
        refused(["--load", str(directory), "--output", str(tmp_path / "hf")], capsys)
        == f"error: {message}"
    )
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    with pytest.raises(ValueError) as e:
        run_main(*SMALL, "--train_iters=2", f"--load={directory}")
    assert str(e.value) == message
    killed = "global_step1.partial is a checkpoint whose writing was killed"
    with pytest.raises(ValueError, match=killed):  # resuming from save, the SLURM habit
        run_main(*SMALL, "--train_iters=2", f"--save={directory}")
    for target in (directory, directory / "global_step1.partial"):  # the save directory, the tag
        with pytest.raises(ValueError, match=killed):
            check_checkpoint.tag_dir_of(str(target))
    os.rename(ckpt / "global_step1", directory / "global_step1")
    try:  # a complete one beside it, no `latest`: the tag to write, and the partial named
        with pytest.raises(
            ValueError, match=r"no 'latest' file; write the tag .* \(global_step1.partial is a "
        ):
            checkpoint.latest_dir(str(directory))
        (directory / "latest").write_text("global_step1.partial\n")
        with pytest.raises(
            ValueError, match=r"names 'global_step1.partial', which is no checkpoint: "
        ):
            checkpoint.latest_dir(str(directory))
    finally:
        os.rename(directory / "global_step1", ckpt / "global_step1")


SLOW_CHECK = """
import sys, time
sys.path.insert(0, "tools")
import export_hf
def slow(*args, **kwargs):  # the weights and modeling files written, the logit check not yet run
    open(sys.argv[1], "w").close()
    time.sleep(600)
export_hf.compare_logits = slow
sys.exit(export_hf.run(sys.argv[2:]))
"""


def _killed_export(ckpt, out, signum, tmp_path):
    """export_hf's command as a process, paused in its logit check (whatever it wrote is on disk)
    and sent signum; returns the finished process and its stderr."""
    flag = tmp_path / f"reached-{signum}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHECK, str(flag), "--load", str(ckpt), "--output", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not flag.exists() and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        # the weights and config written: the moment a killed export looked finished
        assert [d for d in (out, tmp_path / "hf.partial") if (d / "model.safetensors").exists()]
    except BaseException:
        proc.kill()  # not left asleep
        proc.communicate()
        raise
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=300)
    return proc, err


def _loads(path):
    import transformers

    try:
        transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return False
    return True


@pytest.mark.slow
def test_sigterm_or_kill_9_during_an_export_leaves_nothing_loadable(ckpt, tmp_path):
    """It was: after kill -9 a complete model.safetensors and config.json that transformers loads
    (no tokenizer, no logit check); after SIGTERM exit 143 with no message and a lone
    config.json."""
    out = tmp_path / "hf"
    proc, err = _killed_export(ckpt, out, signal.SIGTERM, tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == (
        f"error: SIGTERM: the export was stopped, {out}.partial removed; "
        f"nothing was written at {out}"
    )
    assert not out.exists() and not (tmp_path / "hf.partial").exists()

    proc, err = _killed_export(ckpt, out, signal.SIGKILL, tmp_path)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and not _loads(out) and not _loads(tmp_path)
    assert (
        tmp_path / "hf.partial" / "model.safetensors"
    ).exists()  # the kill left it: only the name says so
    # the next export names it, removes it (its marker says whose it was) and writes the export
    run = subprocess.run(
        [sys.executable, "tools/export_hf.py", "--load", str(ckpt), "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        f"removing {out}.partial: a half-finished export, left by an export (pid {proc.pid}) that "
        "was killed before it completed" in run.stdout
    )
    assert _loads(out) and not (tmp_path / "hf.partial").exists()


# -----------------------------------------------------------------------------
# tools/evaluate.py: an --output_path it cannot write is refused before the evaluation


def test_an_unwritable_output_path_is_refused_before_the_evaluation(ckpt, tmp_path, monkeypatch):
    """It was a raw errno after the whole evaluation, naming no flag."""

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the evaluation started")

    monkeypatch.setattr(eval_harness, "task_manager", no_evaluation)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    (tmp_path / "results").mkdir()
    for output_path, message in (
        (
            a_file / "results.json",
            f"--output_path {a_file}/results.json cannot be written: {a_file} is a file, "
            "not a directory",
        ),
        (
            a_file / "deeper" / "results.json",
            f"deeper/results.json cannot be written: {a_file} is a file",
        ),
        (
            tmp_path / "results",
            f"--output_path {tmp_path / 'results'} is a directory; give a file name",
        ),
        (a_file, f"--output_path {a_file} exists and is not lm-eval results"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            evaluate_tool.main(
                ["--load", str(ckpt), "--tasks", "x", "--output_path", str(output_path)]
            )
    assert a_file.read_text() == "keep me"


def test_a_failed_results_write_names_the_flag_and_leaves_no_file(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    path = tmp_path / "results.json"
    real_replace = os.replace

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(f"--output_path {path}: the results cannot be written (No space left"),
    ):
        evaluate_tool.write_results({"results": {}}, str(path))
    monkeypatch.setattr(os, "replace", real_replace)
    assert os.listdir(tmp_path) == []
