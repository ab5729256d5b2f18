"""The documentation: README.md and docs/*.md render (balanced code fences), README's Python examples run
on the CPU as written, relative links resolve, and no project file refers to notes outside the project."""
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = "`" * 3
# Files outside the project that nothing in it may cite. Built by concatenation so that this file does not
# contain them itself.
OUTSIDE_REFERENCES = ("design" + ".md", "nvfp4" + "-numerics", "cutlass" + "-notes", "style" + "-anchors",
                      ".." + "/shared")
# What the project consists of, for the outside-reference scan.
PROJECT_PARTS = ("README.md", "docs", "runtime", "codegen", "templates", "tests", "bench", "build.py",
                 "pyproject.toml", ".ci")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fence_problems(text: str) -> list:
    """Unbalanced or malformed code fences: a closing fence must be a line of nothing but backticks (at
    least as many as its opening fence), and every opened block must be closed."""
    problems, opened_at, opened_len = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped.startswith(FENCE):
            continue
        ticks = len(stripped) - len(stripped.lstrip("`"))
        if opened_at is None:
            opened_at, opened_len = number, ticks
        elif set(stripped) == {"`"} and ticks >= opened_len:
            opened_at = None
        else:
            problems.append(f"line {number}: {stripped!r} inside the code block opened at line {opened_at}; a "
                            f"closing fence holds nothing but backticks")
    if opened_at is not None:
        problems.append(f"the code block opened at line {opened_at} is never closed")
    return problems


def code_blocks(text: str, language: str) -> list:
    """(line number of the opening fence, source) of every fenced block whose info string is `language`."""
    blocks, info, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if info is None and stripped.startswith(FENCE):
            info, start, lines = stripped.lstrip("`").strip(), number, []
        elif info is not None and stripped.startswith(FENCE) and set(stripped) == {"`"}:
            if info == language:
                blocks.append((start, "\n".join(lines) + "\n"))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def _without_fences(text: str) -> str:
    """The text without its fenced code blocks."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith(FENCE):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return "\n".join(lines)


def _without_code(text: str) -> str:
    """The text without fenced blocks and inline code spans (links are not parsed inside code)."""
    return re.sub(r"(`+)(?:.+?)\1", "", _without_fences(text))


def heading_anchors(text: str) -> set:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors, seen = set(), {}
    for line in _without_fences(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "api.md", "numerics.md", "kernel-specs.md", "kernel-selection.md", "recipes.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_code_fences_are_balanced(path):
    assert fence_problems(path.read_text()) == []


def test_fence_check_catches_text_after_a_closing_fence():
    assert fence_problems(f"{FENCE}yaml\na: 1\n{FENCE} Each variant\ntext\n")
    assert fence_problems(f"{FENCE}python\nx = 1\n")
    assert fence_problems(f"{FENCE}python\nx = 1\n{FENCE}\n\n{FENCE}bash\nls\n{FENCE}\n") == []


README_PYTHON = code_blocks((ROOT / "README.md").read_text(), "python")


def test_readme_has_python_examples():
    assert README_PYTHON


@pytest.mark.parametrize("line,source", README_PYTHON, ids=[f"line{n}" for n, _ in README_PYTHON])
def test_readme_python_example_runs_on_cpu(line, source, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only machine
    monkeypatch.delenv("FP4GEN_BACKEND", raising=False)
    monkeypatch.chdir(tmp_path)  # anything an example writes lands here
    exec(compile(source, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


def _project_text_files():
    for part in PROJECT_PARTS:
        path = ROOT / part
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in paths:
            if SKIPPED_DIRS & set(p.relative_to(ROOT).parts) or p == Path(__file__).resolve():
                continue
            raw = p.read_bytes()
            if b"\0" in raw:
                continue  # binary (golden .npz vectors)
            try:
                yield p, raw.decode("utf-8")
            except UnicodeDecodeError:
                continue


def test_no_file_refers_to_notes_outside_the_project():
    found = []
    for path, text in _project_text_files():
        for number, line in enumerate(text.splitlines(), 1):
            hits = [s for s in OUTSIDE_REFERENCES if s in line]
            if hits:
                found.append(f"{_rel(path)}:{number}: {', '.join(hits)}")
    assert found == [], "files refer to notes outside the project:\n" + "\n".join(found)


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(_without_code(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if ROOT.resolve() not in (resolved, *resolved.parents):
            broken.append(f"{target}: outside the project")
        elif not resolved.exists():
            broken.append(f"{target}: {resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_rel(resolved)}")
    assert broken == []
