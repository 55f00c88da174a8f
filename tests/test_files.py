"""files.py: what a tool writes is checked before its work and written whole, over nothing it did not write."""

import os
import re
import stat

import pytest

import files

OURS = (
    lambda p: open(p).read().startswith("ours"),
    "a table of ours",
    "we write over our own only",
)


def test_a_path_that_cannot_be_written_or_a_file_not_ours_is_refused_and_kept(tmp_path):
    theirs = tmp_path / "theirs.md"
    theirs.write_text("the user's notes")
    for path, said in [
        (tmp_path, f"--out {tmp_path} is a directory; give a file name, e.g. {tmp_path / 'x.md'}"),
        (theirs, f"--out {theirs} exists and is not a table of ours; give another file (we write"),
        (
            theirs / "deeper" / "x.md",
            f"--out {theirs}/deeper/x.md cannot be written: {theirs} is a file, not a directory",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(said)):
            files.check_output_file(str(path), "--out", "x.md", OURS)
    assert theirs.read_text() == "the user's notes"
    # with ours None the tool writes over any file; a missing folder is the write's to create
    files.check_output_file(str(theirs), "--out", "x.md")
    files.check_output_file(str(tmp_path / "new" / "folders" / "x.md"), "--out", "x.md", OURS)
    (tmp_path / "mine.md").write_text("ours, from the last run")
    files.check_output_file(str(tmp_path / "mine.md"), "--out", "x.md", OURS)


def test_an_unwritable_directory_is_refused(tmp_path, monkeypatch):
    # root (CI) writes anywhere: os.access is what the check asks, so it is what the test stands in for
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path))
    with pytest.raises(ValueError, match=f"cannot be written: {tmp_path} is not writable"):
        files.check_output_file(str(tmp_path / "a" / "x.md"), "--out", "x.md")


@pytest.mark.parametrize(
    "key, read_only_ok",
    [("tensorboard_dir", False), ("data_cache_dir", True), ("spike_guard_snapshot_dir", False)],
)
def test_a_directory_the_run_writes_in_is_checked_before_any_work(
    tmp_path, monkeypatch, key, read_only_ok
):
    """Under a file, a bare NotADirectoryError came at the first write, after the data's build (tensorboard_dir's
    a traceback); unwritable, a bare errno. An existing index cache may be read-only (built before)."""
    import arguments

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    guard = ["--spike_guard"] if key == "spike_guard_snapshot_dir" else []

    def error(path):
        with pytest.raises(ValueError) as e:
            arguments.validate(
                arguments.load_config(["--train_iters=2", *guard, f"--{key}={path}"])
            )
        return str(e.value)

    assert error(blocker / "deeper") == (
        f"{key}={blocker}/deeper cannot be created: {blocker} is a file, not a directory; give a directory "
        f"the run can {'write its sample index in' if key == 'data_cache_dir' else 'write'}"
        + (" (a node-local disk, e.g. $SLURM_TMPDIR)" if guard else "")
    )
    assert error(blocker).startswith(f"{key}={blocker} is not a directory: give a directory")
    arguments.validate(
        arguments.load_config(["--train_iters=2", *guard, f"--{key}={tmp_path / 'new' / 'x'}"])
    )
    assert not (tmp_path / "new").exists()  # checked, not created: the run creates it
    monkeypatch.setattr(
        os, "access", lambda path, mode: path != str(tmp_path)
    )  # root writes anywhere
    if read_only_ok:
        arguments.validate(arguments.load_config(["--train_iters=2", f"--{key}={tmp_path}"]))
    else:
        assert error(tmp_path).startswith(f"{key}={tmp_path} is not writable: give a directory")


def test_a_write_is_whole_or_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "deeper" / "table.md"
    files.write_text("first\n\n", str(path))
    assert path.read_text() == "first\n"  # one newline at the end
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()  # not mkstemp's 0600
    with pytest.raises(RuntimeError, match="killed"):
        with files.replaced(str(path)) as tmp:
            assert tmp.endswith(".md") and os.path.dirname(tmp) == str(path.parent)
            with open(tmp, "w") as f:
                f.write("half of the second")
            raise RuntimeError("killed half way")
    assert path.read_text() == "first\n" and os.listdir(path.parent) == ["table.md"]
    files.write_text("second", str(path))
    assert path.read_text() == "second\n" and os.listdir(path.parent) == ["table.md"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
