"""bench/VALIDATION.md is written by several scripts, each owning one `## ` section: `replace_section`
swaps a script's section in place (or appends it), keeps the others, and writes atomically."""

from __future__ import annotations

import os
import re

from peakledger.simulator.safe_io import write_atomic

VALIDATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "VALIDATION.md")


def replace_section(heading: str, section: str, path: str = VALIDATION) -> None:
    text = open(path).read() if os.path.exists(path) else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=\n## |\Z)", re.S)
    if heading in text:
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    write_atomic(path, text.encode())


def replace_sections(text: str, path: str) -> None:
    """Every `## ` section of `text` swapped into `path` in place (or appended); the file's other sections and
    its title stay. A new file gets `text` as it is."""
    if not os.path.exists(path):
        write_atomic(path, text.encode())
        return
    for part in re.split(r"\n(?=## )", text)[1:]:
        replace_section(part.split("\n", 1)[0], part.rstrip("\n") + "\n", path)
