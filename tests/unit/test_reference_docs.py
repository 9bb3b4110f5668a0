"""The documentation stays true and navigable.

* The generated reference pages (``docs/reference/config.md``, ``metrics.md``, ``cli.md``) are what
  ``python -m apsd.reference`` writes from the code now.
* README.md stays a landing page: at most 300 lines.
* Every relative link in README.md and ``docs/**/*.md`` reaches a file in the repository, and every
  ``#anchor`` a heading of the page it names (GitHub's anchors).
* Neither README nor docs point at what a reader cannot see: ``../shared``, "issue <number>" or
  "seed document(s)" (the simulator's own output, ``docs/research.md`` and ``docs/research/``, may
  say "seed" when it means a random seed, so it is left out of that one check).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from apsd import reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- generated pages -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return reference.generate()


def test_the_generated_reference_pages_are_current(generated):
    stale = reference.stale_pages(ROOT, generated)
    shown = []
    for diff in stale.values():
        lines = diff.splitlines()
        shown.append("\n".join(lines[:40]) + (f"\n... ({len(lines) - 40} more lines)" if len(lines) > 40 else ""))
    assert not stale, ("stale generated pages: run `python -m apsd.reference` and commit them\n\n"
                       + "\n\n".join(shown))


def test_generation_is_deterministic(generated):
    assert reference.generate() == generated


def test_the_command_rewrites_and_checks(generated, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "generate", lambda: dict(generated))
    assert reference.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert all(f"{path} is stale" in err for path in generated), err
    assert reference.main([]) == 0
    assert {rel_path: (tmp_path / rel_path).read_text() for rel_path in generated} == generated
    assert reference.main(["--check"]) == 0
    (tmp_path / "docs/reference/cli.md").write_text("edited by hand\n")
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err.splitlines() == ["docs/reference/cli.md is stale: run python -m apsd.reference"]


def test_the_pages_hold_what_the_code_defines(generated):
    from apsd.core.config import Config

    config = generated["docs/reference/config.md"]
    for section in ("server", "queue", "engine", "gpu", "store", "[backends]", "tenants.<name>", "policy.fair"):
        assert f"`[{section}]`" in config, section
    assert "| `shutdown_grace_s` | number | `30.0` | 0 to 86400 |" in config
    assert f"| `preset` | string | `\"{Config().policy.preset}\"` |" in config
    metrics = generated["docs/reference/metrics.md"]
    assert "| `apsd_requests_total` | counter | `tenant`, `outcome` (`admitted`, " in metrics
    assert "`apsd_ttft_seconds_bucket`" in metrics
    cli = generated["docs/reference/cli.md"]
    for command in ("apsd", "apsd hash-key", "apsd plugins", "apsd simulate", "apsd research", "apsd profile"):
        assert f"## `{command}`\n" in cli, command
    assert "`--replicas N`" in cli and "`noisy-neighbor`" in cli


# -- the README ------------------------------------------------------------------------------------

def test_the_readme_is_a_landing_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


# -- links -----------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = "\n".join(_INLINE_CODE.sub("", line) for line in prose_lines(path.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def test_links_are_found():
    assert any(target.startswith("docs/") for target in links(README))
    assert slug("`[tenants.<name>]`") == "tenantsname" and slug("Lazy aging, exactly") == "lazy-aging-exactly"
    assert links(ROOT / "docs/reference/metrics.md")  # the generated pages link too


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if _SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        try:
            file.relative_to(ROOT)
        except ValueError:
            broken.append(f"{target}: outside the repository")
            continue
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {rel(file)}")
    assert not broken, f"{rel(page)}: broken links:\n" + "\n".join(broken)


# -- what a reader cannot see ---------------------------------------------------------------------

FORBIDDEN = {
    "../shared": re.compile(r"\.\./shared"),
    "issue <number>": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "seed document(s)": re.compile(r"\bseed[\s-]+documents?\b", re.IGNORECASE),
}
#: The simulator's own output, which says "seed" for a workload's random seed.
SIMULATOR_OUTPUT = ("docs/research.md", "docs/research/")


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_references_a_reader_cannot_follow(page):
    text = page.read_text(encoding="utf-8")
    found = []
    for name, pattern in FORBIDDEN.items():
        if name.startswith("seed") and rel(page).startswith(SIMULATOR_OUTPUT):
            continue
        found += [f"{name}: line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not found, f"{rel(page)} mentions what its reader cannot see:\n" + "\n".join(found)
