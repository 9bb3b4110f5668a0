"""For every test, here and in plugins/: a state directory of its own.

A daemon keeps its state (tenants and keys managed through /admin, bucket levels, usage) in a
SQLite file under ``$XDG_STATE_HOME`` by default; each test gets an empty one, so no test sees
what another left there, and none writes to the home directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def own_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "xdg-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    return state
