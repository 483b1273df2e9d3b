"""The README and docs/ hold together (docs/status.md, "Tests"): every relative link resolves to a
file of the repository (and its anchor to a heading of that file), every ``raycompat <job>`` names
a registered job, and every ``jobs/``, ``bench/`` and ``tests/`` script named exists.

Pages: ``README.md`` and ``docs/*.md`` of a repository root. Links are markdown links outside
code (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``); links with a scheme
(``https:``, ``mailto:``) are not checked. Anchors are GitHub's heading slugs. A ``raycompat
<job>`` command is code: it is looked for in fenced blocks and inline code spans only, where
prose ("raycompat trains ...") cannot be mistaken for one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import locations

from raycompat.cli import JOBS

REPO = Path(locations.REPO)
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
#: ``raycompat <job>``: not part of a path or a module name (``~/raycompat x``, ``raycompat.cli``)
JOB_IN_FENCE = re.compile(r"(?<![\w./~-])raycompat[ \t]+([A-Za-z0-9][\w-]*)")
JOB_IN_SPAN = re.compile(r"(?<![\w./~-])raycompat\s+([A-Za-z0-9][\w-]*)")
SCRIPT = re.compile(r"(?<![\w./-])((?:jobs|bench|tests)/[\w-]+\.py)\b")


def pages(root: Path) -> list[Path]:
    """``README.md`` and every ``docs/*.md`` under ``root`` that exists."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    return found + sorted((root / "docs").glob("*.md"))


def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(prose, fenced)``: the lines outside and inside fenced code blocks, with line numbers."""
    prose, fenced, in_fence = [], [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        (fenced if in_fence else prose).append((number, line))
    return prose, fenced


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link targets and markup dropped, lower case, punctuation
    other than ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeated headings get ``-1``, ``-2``, ...)."""
    prose, _ = split_code(path.read_text(encoding="utf-8"))
    counts: dict[str, int] = {}
    found = set()
    for _, line in prose:
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(f"{base}-{counts[base]}" if base in counts else base)
            counts[base] = counts.get(base, 0) + 1
    return found


def paragraphs(lines: list[tuple[int, str]]) -> Iterable[tuple[int, str]]:
    """Runs of consecutive non-blank prose lines joined, each with its first line number (an
    inline code span may break across lines, not across paragraphs or code blocks)."""
    start, block = 0, []
    for number, line in [*lines, (-1, "")]:
        if block and (not line.strip() or number != start + len(block)):
            yield start, "\n".join(block)
            start, block = 0, []
        if line.strip():
            start = start or number
            block.append(line)


def link_problems(page: Path, root: Path, number: int, target: str) -> list[str]:
    """What is wrong with one link of ``page`` (``[]`` when it resolves)."""
    where = f"{page.relative_to(root)}:{number}"
    if SCHEME.match(target):
        return []
    path_part, _, anchor = target.partition("#")
    if path_part.startswith("/"):
        return [f"{where}: link {target!r} is an absolute path; link within the repository"]
    resolved = (page.parent / path_part).resolve() if path_part else page
    if not resolved.is_relative_to(root.resolve()):
        return [f"{where}: link {target!r} points outside the repository"]
    if not resolved.exists():
        return [f"{where}: link {target!r}: no file {path_part!r}"]
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        name = resolved.relative_to(root.resolve())
        return [f"{where}: link {target!r}: no heading with anchor #{anchor} in {name}"]
    return []


def check_page(page: Path, root: Path, jobs: Iterable[str]) -> list[str]:
    """Every problem of one page: broken links and anchors, unknown jobs, missing scripts."""
    text = page.read_text(encoding="utf-8")
    prose, fenced = split_code(text)
    problems = []
    codes: list[tuple[int, str, re.Pattern]] = [(n, line, JOB_IN_FENCE) for n, line in fenced]
    for start, paragraph in paragraphs(prose):
        for match in INLINE_CODE.finditer(paragraph):
            codes.append(
                (start + paragraph.count("\n", 0, match.start()), match.group(2), JOB_IN_SPAN)
            )
        outside = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), paragraph)
        for match in LINK.finditer(outside):
            number = start + outside.count("\n", 0, match.start())
            problems += link_problems(page, root, number, match.group(1))
    for number, code, pattern in codes:
        for match in pattern.finditer(code):
            if match.group(1) not in jobs:
                known = ", ".join(sorted(jobs))
                problems.append(
                    f"{page.relative_to(root)}:{number}: `raycompat {match.group(1)}` is not a "
                    f"registered job (raycompat/cli.py: {known})"
                )
    for number, line in enumerate(text.splitlines(), start=1):
        for match in SCRIPT.finditer(line):
            if not (root / match.group(1)).is_file():
                problems.append(f"{page.relative_to(root)}:{number}: no script {match.group(1)}")
    return problems


def check_docs(root: Path, jobs: Iterable[str]) -> list[str]:
    """Every problem of every page under ``root``, each naming the file and line."""
    jobs = set(jobs)
    return [problem for page in pages(root) for problem in check_page(page, root, jobs)]


def test_readme_and_docs_links_jobs_and_scripts_resolve():
    assert check_docs(REPO, JOBS) == []


def test_readme_is_short_and_reaches_every_guide_in_one_click():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "(docs/your-images.md)" in readme
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not list {page.name}"
            assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_checker_reports_broken_links_anchors_unknown_jobs_and_missing_scripts(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "train.py").write_text("")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "Fine: [guide](docs/guide.md#a-b-c), [self](#top), [web](https://example.org/x.md).\n"
        "Broken: [gone](docs/missing.md) and [bad anchor](docs/guide.md#nowhere).\n"
        "Outside: [shared](../shared/METHODS.md).\n\n"
        "```bash\nraycompat train --epochs 1\nraycompat no-such-job --out x\n"
        "python jobs/train.py\npython bench/nope.py\n```\n\n"
        "In prose raycompat trains; in code `raycompat\nbogus-job`.\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## A, b: `c`\n\nBack to [the top](../README.md#top).\n"
    )
    problems = check_docs(tmp_path, {"train"})
    assert problems == [
        "README.md:4: link 'docs/missing.md': no file 'docs/missing.md'",
        "README.md:4: link 'docs/guide.md#nowhere': no heading with anchor #nowhere in "
        "docs/guide.md",
        "README.md:5: link '../shared/METHODS.md' points outside the repository",
        "README.md:9: `raycompat no-such-job` is not a registered job (raycompat/cli.py: train)",
        "README.md:14: `raycompat bogus-job` is not a registered job (raycompat/cli.py: train)",
        "README.md:11: no script bench/nope.py",
    ]


def test_slugs_follow_github():
    assert slug("The default run of 2026-11-25") == "the-default-run-of-2026-11-25"
    assert slug("`bench/serve_load.py`") == "benchserve_loadpy"
    assert slug("Embeddings parquet (simulator and live index input)") == (
        "embeddings-parquet-simulator-and-live-index-input"
    )
    assert slug("BCT: sys >= kd >= beta") == "bct-sys--kd--beta"
    assert slug("See [methods](methods.md)") == "see-methods"
