"""ruff (ruff.toml) holds on the whole project: `ruff check` -- an unused import, an undefined name or an
unsorted import block fails the suite, not a review -- and `ruff format --check`: the code is as the formatter
writes it, at line length 100, so a diff shows changes of meaning, never of layout."""

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff(*args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements.txt -c constraints.txt"
    return subprocess.run(
        [ruff, *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_check_passes():
    out = _ruff("check", "--output-format", "concise")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_check_passes():
    out = _ruff("format", "--check")
    assert out.returncode == 0, (
        out.stdout[-4000:] + out.stderr[-2000:] + "\nrun `ruff format .` and commit what it changes"
    )
