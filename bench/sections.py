"""bench/VALIDATION.md is written by several scripts, each owning one `## ` section: `replace_section`
swaps a script's section in place (or appends it), keeps the others, and writes atomically."""

from __future__ import annotations

import os
import re

from peakledger.simulator.files import write_atomic

VALIDATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "VALIDATION.md")


def replace_section(heading: str, section: str, path: str = VALIDATION) -> None:
    text = open(path).read() if os.path.exists(path) else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=\n## |\Z)", re.S)
    if heading in text:
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    write_atomic(path, text.encode())
