"""Ruff, with the rules of ``[tool.ruff]`` in pyproject.toml, finds nothing in the project's code: the
package, its plugins, the tests and the benchmarks. (Run ``.venv/bin/ruff check --fix`` to sort imports
and fix what it can; the rest it names.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff() -> str:
    """The ``ruff`` installed beside this Python (the test extra pins it), else on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return found


def test_ruff_finds_nothing():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "apsd", "plugins", "tests",
                             "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
