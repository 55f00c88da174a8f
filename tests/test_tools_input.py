"""The small tools refuse bad input with one message naming the problem and the fix, before any work,
with a non-zero exit and no traceback: each tool's main run in this process on tiny inputs."""

import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_index  # noqa: E402


def refused(main, argv, capsys):
    """main(argv) ends with argparse's error: exit 2, its message the last line; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_index_refuses_sizes_it_cannot_build_and_a_dir_it_cannot_use(
    tmp_path, capsys, monkeypatch
):
    """--mean_doc_tokens 0 and --seq_length 0 were a ZeroDivisionError, --samples -5 ran and exited
    0, a missing --dir or one under a file a traceback from tempfile."""

    def no_corpus(*args):
        raise AssertionError("the corpus was written")

    monkeypatch.setattr(bench_index, "write_synthetic_corpus", no_corpus)
    (tmp_path / "afile").write_text("mine")
    for flags, said in [
        (["--samples=10", "--mean_doc_tokens=0"], "--mean_doc_tokens 0.0 must be above 0"),
        (["--samples=10", "--seq_length=0"], "--seq_length 0 must be at least 1"),
        (["--samples=-5"], "--samples -5 must be at least 1"),
        (["--samples=10", "--corpus_tokens=0"], "--corpus_tokens 0 must be at least 1"),
        (["--samples=10", "--epochs=0"], "--epochs 0.0 must be above 0"),
        (
            ["--samples=10", "--dir", str(tmp_path / "missing")],
            f"--dir {tmp_path / 'missing'} does not exist: give an existing directory",
        ),
        (
            ["--samples=10", "--dir", str(tmp_path / "afile" / "d")],
            f"--dir={tmp_path / 'afile' / 'd'} cannot be created: {tmp_path / 'afile'} is a file",
        ),
    ]:
        line = refused(bench_index.main, flags, capsys)
        assert line.endswith(f": error: {said}") or f": error: {said}" in line, line
    assert os.listdir(tmp_path) == ["afile"]
