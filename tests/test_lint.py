"""The code passes the project's linter as configured in pyproject.toml ([tool.ruff]: line length 120; pycodestyle,
pyflakes and isort rules), so CI (which runs this suite) keeps it that way."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency: pip install -e '.[dev]'"
    done = subprocess.run([ruff, "check", "--no-cache", str(REPO)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
