"""The reading path holds together: every relative link in README.md, BENCHMARKS.md, DEVELOPERS.md, docs/*.md
and the benchmark pages under benchmarks/results/ names a file that exists, and a `#anchor` names a heading of
that file (as GitHub makes anchors of headings). A moved or renamed section fails here, not in a reader's
browser."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def documents(root: Path = REPO) -> list[Path]:
    found = [root / "README.md", root / "BENCHMARKS.md", root / "DEVELOPERS.md"]
    found += sorted((root / "docs").glob("*.md")) + sorted((root / "benchmarks" / "results").glob("*.md"))
    return [path for path in found if path.exists()]


def outside_fences(text: str) -> list[str]:
    """Every line, fenced code blocks blanked (a `# comment` there is no heading, a link no link); line i of
    the result is line i of the file."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def prose_lines(text: str) -> list[str]:
    """outside_fences, with inline code spans removed too: a link inside one is only text."""
    return [re.sub(r"`[^`]*`", "", line) for line in outside_fences(text)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, spaces and hyphens
    stay), each space a hyphen."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in the file; a repeated heading gets -1, -2... as on GitHub."""
    seen: dict[str, int] = {}
    for line in outside_fences(path.read_text()):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            name = anchor(heading.group(1))
            count = seen.get(name, 0)
            seen[name] = count + 1
            if count:
                seen[f"{name}-{count}"] = 1
    return set(seen)


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, line in enumerate(prose_lines(path.read_text()), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
                continue
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and (linked.suffix != ".md" or fragment not in anchors(linked)):
                broken.append(f"{where} (no such heading)")
    return broken


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_reading_path_is_linked_from_the_readme():
    """README.md is where a newcomer starts: each page of the path is one link away."""
    readme = " ".join(prose_lines((REPO / "README.md").read_text()))
    for page in ("docs/usage.md", "docs/operations.md", "docs/models.md", "docs/architecture.md", "BENCHMARKS.md"):
        assert f"]({page}" in readme, page


def test_the_checker_sees_a_planted_broken_link(tmp_path, monkeypatch):
    """A link to a missing file, one to a missing heading and one to a present heading, in a copy of the
    layout: the first two are reported, the third is not; a link inside code is not a link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text("# Using the server\n\n## What it reuses\ntext\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\nSee [usage](docs/usage.md#what-it-reuses), [gone](docs/gone.md),\n"
        "[no heading](docs/usage.md#what-it-forgets) and [here](#title).\n"
        "```\n[in code](docs/nowhere.md)\n```\n`[inline](docs/nowhere.md)`\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert documents(tmp_path) == [tmp_path / "README.md", tmp_path / "docs" / "usage.md"]
    assert broken_links(tmp_path / "README.md") == [
        "README.md:3: docs/gone.md (no such file)",
        "README.md:4: docs/usage.md#what-it-forgets (no such heading)",
    ]
