"""Ruff, with the rules of ``[tool.ruff]`` in pyproject.toml, finds nothing in the project's code: the
package, its plugins, the tests and the benchmarks. (Run ``.venv/bin/ruff check --fix`` to sort imports
and fix what it can; the rest it names.) Mypy, with the settings of ``[tool.mypy]``, finds nothing in the
package. (Run ``.venv/bin/mypy``: with no arguments it checks what the config names.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    """The ``name`` installed beside this Python (the test extra pins it), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def test_ruff_finds_nothing():
    result = subprocess.run([tool("ruff"), "check", "--no-cache", "--output-format", "concise", "apsd", "plugins", "tests",
                             "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


@pytest.mark.timeout(660)  # (past the run's own limit: a cold run takes about a minute, a warm one seconds)
def test_mypy_finds_nothing():
    result = subprocess.run([tool("mypy"), "--config-file", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
