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
