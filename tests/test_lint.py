"""ruff check (ruff.toml's rules) passes on the whole project: an unused import, an undefined name or an
unsorted import block fails the suite, not a review."""

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements.txt -c constraints.txt"
    out = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
