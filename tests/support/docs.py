"""The documentation's pages and their fenced code blocks, for the tests that run them
(tests/test_docs.py: Python and shell; tests/test_readme_cli.py: ``conveyor`` commands)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages() -> list[Path]:
    """README.md, then every page of the site in the order of its navigation
    (mkdocs.yml), the generated API pages left out."""
    nav = re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$",
                     (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)
    return [ROOT / "README.md", *[ROOT / "docs" / page for page in nav
                                  if not page.startswith("api/")]]


@dataclass
class Block:
    """A fenced code block: its page, first line (1-based, the fence's), language (the
    info string's first word, "" for none) and lines."""

    page: Path
    line: int
    language: str
    lines: list[str]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def code(self) -> str:
        return "\n".join(self.lines) + "\n"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order (indented fences included)."""
    found: list[Block] = []
    current: Block | None = None
    indent = ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.lstrip()
        if current is None and stripped.startswith("```"):
            indent = line[:len(line) - len(stripped)]
            info = stripped[3:].strip().split()
            current = Block(page, number, info[0] if info else "", [])
        elif current is not None and stripped.startswith("```"):
            found.append(current)
            current = None
        elif current is not None:
            current.lines.append(line.removeprefix(indent))
    assert current is None, f"{page}: a code block is not closed"
    return found
