"""Names the user types (a model, a precision, a card, an engine, an optimizer, any value of a list): the one place
that says "did you mean", so every refusal of a name suggests the same way.

A name is compared by its letters and digits only, lower-cased (`normal`: `llama3-8b` and `Llama-3-8B` are both
`llama38b`; `RTX4090` is `rtx4090`). The suggestion (`close_names`), first rule that gives one:
1. an alias the list declares (`bfloat16` -> `bf16`, `fsdp` -> `fsdp2`), by its normal form;
2. the names whose normal form equals the value's (`adamW` -> `adamw`);
3. the one name whose normal form starts with the value's, two characters or more (`hf` -> `hf-trainer`);
4. the names whose normal form holds the value's (`4090` -> `RTX-4090-24GB`), when at most three do;
5. the closest by difflib's ratio (`SequenceMatcher`, at least `get_close_matches`' default cutoff 0.6) on the
   normal forms, all those tied for the best.
A suggestion is never taken in the value's place: the user's text is refused, and the message names what to type.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

SUBSTRING_MIN = 3  # a value this short holds too little to pick names by (`a` is in most)
SUBSTRING_MAX = 3  # more names than this hold the value: too many to be a suggestion


def normal(name: object) -> str:
    """`name` lower-cased, only its letters and digits kept."""
    return "".join(c for c in str(name).lower() if c.isalnum())


def close_names(value: object, allowed: Iterable, aliases: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The allowed names `value` was probably meant to be (none when nothing is close), in `allowed`'s order."""
    names = [str(a) for a in allowed]
    key = normal(value)
    if not key:
        return ()
    for alias, target in (aliases or {}).items():
        if normal(alias) == key and target in names:
            return (target,)
    by_normal: dict[str, list[str]] = {}
    for name in names:
        by_normal.setdefault(normal(name), []).append(name)
    if key in by_normal:
        return tuple(by_normal[key])
    starting = [n for n in names if normal(n).startswith(key)]
    if len(key) >= 2 and len(starting) == 1:
        return tuple(starting)
    if len(key) >= SUBSTRING_MIN:
        holding = [n for n in names if key in normal(n)]
        if 0 < len(holding) <= SUBSTRING_MAX:
            return tuple(holding)
    scored = [(difflib.SequenceMatcher(None, key, k).ratio(), k) for k in by_normal]
    best = max((score for score, _ in scored), default=0.0)
    if best < 0.6:  # difflib.get_close_matches' default cutoff
        return ()
    chosen = {k for score, k in scored if score == best}
    return tuple(n for n in names if normal(n) in chosen)


def did_you_mean(value: object, allowed: Iterable, aliases: Mapping[str, str] | None = None) -> str:
    """"; did you mean 'x'?" (or "'x' or 'y'") for a refused `value`, "" when no allowed name is close: the end of
    the refusal's message."""
    close = close_names(value, allowed, aliases)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(n) for n in close) + "?"


__all__ = ["normal", "close_names", "did_you_mean"]
