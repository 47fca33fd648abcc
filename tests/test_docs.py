"""The docs hold together: every relative link reaches what it names, and the guide's contents are its sections.

Every relative link of the README, CONTRIBUTING.md, CHANGELOG.md and docs/: a link to a file names one that
exists; a link to a heading (`guide.md#mixture-of-experts`, or `#...` on the same page) names a heading that
page has, by GitHub's anchors; a link to a line (`gpt.py#L249`) names a line the file has. Links inside fenced
code blocks are code, not links, and are left alone.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... after the first, as GitHub numbers it."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        name = anchor(heading)
        found.add(name if not seen[name] else f"{name}-{seen[name]}")
        seen[name] += 1
    return found


def relative_links(page: Path) -> list[str]:
    """The link targets of a page outside its code blocks that are not a URL (http:, https:, mailto:)."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_anchors_are_githubs() -> None:
    assert anchor("FlashAttention: exact attention in O(n) memory") == "flashattention-exact-attention-in-on-memory"
    assert anchor("GGUF: llama.cpp and Ollama") == "gguf-llamacpp-and-ollama"
    assert anchor("### 2. `files/`".lstrip("# ")) == "2-files"
    assert anchor("Hugging Face in and out, attention maps") == "hugging-face-in-and-out-attention-maps"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_heading_or_line_that_exists(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif fragment and (line := re.fullmatch(r"L(\d+)", fragment)):
            if int(line[1]) > len(file.read_text(encoding="utf-8").splitlines()):
                broken.append(f"{target}: {file.name} is shorter")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading '{fragment}' in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_guides_contents_list_each_of_its_sections_in_order() -> None:
    guide = ROOT / "docs" / "guide.md"
    text = FENCE.sub("", guide.read_text(encoding="utf-8"))
    contents = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[.+?\]\(#(.+?)\)$", contents, re.M)
    sections = [anchor(heading) for heading in re.findall(r"^## (.+)$", text, re.M) if heading != "Contents"]
    assert listed == sections, "docs/guide.md's Contents are not its ## sections, in order"
