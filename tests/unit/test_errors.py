"""The error catalogue (apsd/core/errors.py) is complete both ways: every code the package answers
with is in it, with the status it is answered with, and every code in it is answered somewhere.

The package's codes are read from its source: the code (second argument) of every call that makes an
error (``Refusal``, ``BodyError``, ``AdminError``, ``BackendError``; ``_unauthorized``'s first), the
codes the HTTP layer ``names`` for Quart's own answers (404, 405, 408, 413), and the module constants that hold
one (``DEADLINE_UNMEETABLE``)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from apsd.core.errors import CATALOGUE, by_code

PACKAGE = Path(__file__).resolve().parents[2] / "apsd"
#: Calls that make an error answer: (function name, index of the status argument or None, of the code).
MAKERS = {"Refusal": (0, 1), "BodyError": (0, 1), "AdminError": (0, 1), "BackendError": (0, 1),
          "_unauthorized": (None, 0)}


@functools.cache
def answered() -> dict[str, set[int | None]]:
    """code -> the statuses the package answers it with (None: not a literal at that call)."""
    found: dict[str, set[int | None]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name not in MAKERS:
                    continue
                status_at, code_at = MAKERS[name]
                if len(node.args) > code_at and isinstance(code := node.args[code_at], ast.Constant) \
                        and isinstance(code.value, str):
                    status = node.args[status_at] if status_at is not None else None
                    value = status.value if isinstance(status, ast.Constant) else None
                    found.setdefault(code.value, set()).add(401 if name == "_unauthorized" else value)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                    any(isinstance(t, ast.Name) and t.id == "names" for t in node.targets):
                for key, value in zip(node.value.keys, node.value.values):   # (the server's own answers)
                    if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                        found.setdefault(value.value, set()).add(key.value)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    any(isinstance(t, ast.Name) and t.id == "DEADLINE_UNMEETABLE" for t in node.targets):
                found.setdefault(node.value.value, set()).add(None)
    return found


def test_the_scan_reads_the_package():
    codes = answered()
    assert {"rate_limited", "missing_api_key", "not_found", "deadline_unmeetable", "state_off"} <= set(codes)
    assert codes["rate_limited"] == {429}


def test_every_code_the_package_answers_is_in_the_catalogue_with_its_status():
    catalogue = by_code()
    missing = sorted(set(answered()) - set(catalogue))
    assert not missing, f"codes answered but not in apsd/core/errors.py: {missing}"
    wrong = {code: (sorted(s for s in statuses if s is not None), catalogue[code].statuses)
             for code, statuses in answered().items()
             if not {s for s in statuses if s is not None} <= set(catalogue[code].statuses)}
    assert not wrong, f"answered with a status the catalogue does not give (answered, catalogue): {wrong}"


def test_every_code_in_the_catalogue_is_answered_somewhere():
    assert len({e.code for e in CATALOGUE}) == len(CATALOGUE), "a code is in the catalogue twice"
    unused = sorted(set(by_code()) - set(answered()))
    assert not unused, f"codes in the catalogue that nothing answers: {unused}"
