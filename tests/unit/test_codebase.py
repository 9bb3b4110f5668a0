"""Rules the source must keep: Trio only, and time only from the trio clock."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "apsd"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_there_is_source_to_check():
    assert len(SOURCES) > 10


def test_no_asyncio_anywhere():
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "asyncio" or n.startswith("asyncio.") for n in names), path


#: The simulator times its own speed (wall seconds around trio.run, outside the virtual clock).
#: OpenAI answers carry ``created``, a Unix timestamp (apsd.serve.http.openai.unix_time; it times nothing);
#: the calendar (budget periods, usage hours, key expiry) is apsd.core.clock.calendar_time.
WALL_CLOCK_ALLOWED = {("runner.py", "perf_counter"), ("openai.py", "time"), ("clock.py", "time")}


def test_time_comes_only_from_trio():
    forbidden = {"time", "monotonic", "perf_counter", "sleep", "time_ns", "monotonic_ns"}
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "time" and node.attr in forbidden and (path.name, node.attr) not in WALL_CLOCK_ALLOWED:
                    raise AssertionError(f"{path}:{node.lineno} reads the real clock: time.{node.attr}")
                if node.value.id in ("datetime", "date") and node.attr in ("now", "utcnow", "today"):
                    raise AssertionError(f"{path}:{node.lineno} reads the real clock")
            if isinstance(node, ast.ImportFrom) and node.module == "time":
                raise AssertionError(f"{path}:{node.lineno} imports from time")
