"""Text from the wire made safe to print: one function for log lines and terminal tables.

An agent's name, version, hostname, device names and facts, and the notes it sends are hostile
until shown otherwise: a newline forges a log line, an ANSI escape rewrites a terminal.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, the Unicode line/paragraph separators and the bidi overrides and isolates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
DEFAULT_LIMIT = 200


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(text: object, limit: int | None = DEFAULT_LIMIT, *, multiline: bool = False) -> str:
    """`text` with every control character shown as an escape, cut to `limit` characters (None: whole).

    multiline keeps line breaks, for a message printed on its own (a traceback, a script's last output)."""
    value = str(text)
    if limit is not None and len(value) > limit:
        value = f"{value[:limit]}… ({len(value)} characters)"
    if multiline:
        return "\n".join(_UNSAFE.sub(_escape, line) for line in value.split("\n"))
    return _UNSAFE.sub(_escape, value)


MAX_LISTED = 20  # names an error lists before "… and N more"
MAX_ERROR_CHARS = 4000  # an error's text on the wire: gRPC carries it in metadata (8 KiB by default, all headers)


def cut_list(names: list[str], limit: int = MAX_LISTED) -> str:
    """`a, b, c` — or the first `limit` and "… and N more", so an error about a lab of 5,000 devices stays short."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} … and {len(names) - limit} more"


def bounded_message(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """A message cut at a line break to at most `limit` characters, saying how many lines were left out."""
    if len(text) <= limit:
        return text
    lines, kept, size = text.split("\n"), [], 0
    for line in lines:
        if size + len(line) + 1 > limit - 60:
            break
        kept.append(line)
        size += len(line) + 1
    if not kept:  # one very long line
        return f"{text[:limit - 60]}… ({len(text)} characters)"
    return "\n".join(kept) + f"\n… and {len(lines) - len(kept)} more line(s)"
