"""The keys two `--json` documents differ by: removed, added and changed values, list indices folded.

    python bench/json_diff.py before.json after.json

Used to show that a refactor changed a report's schema only where it says (issue 24: the renamed
`micro_batch_index` and the schema version); values that differ are printed with both sides.
"""

from __future__ import annotations

import collections
import json
import re
import sys


def differences(a, b) -> collections.Counter:
    out: collections.Counter = collections.Counter()

    def walk(x, y, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                where = re.sub(r"\[\d+\]", "[]", f"{path}/{k}")
                if k not in y:
                    out[f"removed {where}"] += 1
                elif k not in x:
                    out[f"added {where}"] += 1
                else:
                    walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (p, q) in enumerate(zip(x, y)):
                walk(p, q, f"{path}[{i}]")
        elif x != y:
            out[f"changed {path}: {json.dumps(x)[:60]} -> {json.dumps(y)[:60]}"] += 1

    walk(a, b, "")
    return out


def main() -> int:
    before, after = (json.load(open(p)) for p in sys.argv[1:3])
    found = differences(before, after)
    for line in sorted(found):
        print(line + (f" (x{found[line]})" if found[line] > 1 else ""))
    print(f"{len(found)} differences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
