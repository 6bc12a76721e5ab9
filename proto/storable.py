"""Text a lab's store can keep: no NUL, no lone surrogate (issue 33, M5).

PostgreSQL's text and JSON cannot hold U+0000 (a spec_json holding the escape `\\u0000` made every later read of
it fail: `farm artifacts gc` stopped for the whole lab), and a lone surrogate (U+D800-U+DFFF, which a YAML
escape can make) has no UTF-8 form at all, on any store. A job is checked for both when it is submitted, for
every store alike, and refused naming the field.
"""

from __future__ import annotations

from typing import Any, Iterator

MAX_DEPTH = 64  # a job file nests a few levels; deeper is refused elsewhere, never recursed into without end


def _bad_character(text: str) -> str | None:
    for char in text:
        if char == "\x00":
            return "a NUL character (U+0000)"
        if "\ud800" <= char <= "\udfff":
            return f"a lone surrogate (U+{ord(char):04X})"
    return None


def unstorable(value: Any, path: tuple[Any, ...] = (), seen: set[int] | None = None
               ) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(the field's path, what is wrong) for every string, key or value, in `value` a store cannot keep. Each
    container is walked once: YAML aliases share one object many times (an alias bomb is a billion paths to it)."""
    if len(path) > MAX_DEPTH:
        return
    seen = set() if seen is None else seen
    if isinstance(value, str):
        bad = _bad_character(value)
        if bad:
            yield path, bad
    elif isinstance(value, (dict, list, tuple)):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and (bad := _bad_character(key)):
                    yield path, f"a key holding {bad}"
                yield from unstorable(item, (*path, key), seen)
        else:
            for index, item in enumerate(value):
                yield from unstorable(item, (*path, index), seen)


def field_path(path: tuple[Any, ...]) -> str:
    """`workload.args[2]`, as the job file's errors name fields."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "the job"


def refusal(what: str, bad: str) -> str:
    return (f"{what} holds {bad}, which the lab's store cannot keep (PostgreSQL text holds no NUL); remove it, or "
            "write it as an escape the program itself reads")
