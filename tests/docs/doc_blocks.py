"""The fenced code blocks of the documentation that say they are tested: ```` ```bash tested ````,
```` ```python tested ````, ```` ```js tested ````, and the one ```` ```bash tested server ```` that starts the server
the others talk to. Renderers show only the first word of an info string (the language), so the marks stay out of
the reader's way."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "js": "js", "javascript": "js"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # "bash", "python" or "js"
    code: str
    server: bool  # the block starts the server (`bash tested server`)

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def marked_blocks(path: Path) -> list[Block]:
    """The tested blocks of a Markdown file, in order. A tested block in a language the runner cannot run is an
    error (it would silently never run)."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, words = opening["fence"], opening["info"].split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and not lines[j].strip().strip(fence[0])), len(lines))
        if "tested" in words[1:]:
            if words[0] not in LANGUAGES:
                raise ValueError(f"{path.name}:{i + 1}: a tested block in {words[0]!r}, which the runner does not run "
                                 f"(it runs {', '.join(LANGUAGES)})")
            code = "\n".join(line[len(opening["indent"]):] for line in lines[i + 1 : end]) + "\n"
            blocks.append(Block(path, i + 1, LANGUAGES[words[0]], code, "server" in words[1:]))
        i = end + 1
    return blocks
