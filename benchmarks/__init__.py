"""Benchmarks: scripts, not tests (pytest does not collect them), each run from the repository root as
``.venv/bin/python benchmarks/bench_x.py`` (or ``.venv/bin/python -m benchmarks.bench_x``).

One import style: this directory is the ``benchmarks`` package, and every script imports from the
repository root: ``from benchmarks.bench_http import ...`` for another benchmark's code and
``from tests.helpers import ...`` (or the real-server modules ``tests.llama_server``,
``tests.redis_server``) for the tests' helpers. Run as a script, a benchmark first puts the repository
root in place of its own directory at the head of ``sys.path`` (the two lines after its imports of the
standard library), so ``import bench_http`` never works and the one style is the only one.
"""
