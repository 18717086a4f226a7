"""A flattened Metal source as the lint reads it: code only, and where each offset came from."""

from __future__ import annotations

import bisect
import re

_LINE = re.compile(r'^[ \t]*#[ \t]*line[ \t]+(\d+)[ \t]+"([^"]*)"', re.M)
_CODE_SKIPS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def code_only(text: str) -> str:
    """``text`` with comments, string and character literals blanked (newlines
    kept), so that offsets and lines stay those of ``text``."""
    return _CODE_SKIPS.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


class Locations:
    """Maps offsets of a flattened source to ``file:line``, by its ``#line`` directives."""

    def __init__(self, text: str):
        self._line_starts = [0] + [m.end() for m in re.finditer(r"\n", text)]
        self._directives = [(text.count("\n", 0, m.start()), int(m.group(1)), m.group(2))
                            for m in _LINE.finditer(text)]

    def __call__(self, offset: int) -> str:
        line = bisect.bisect_right(self._line_starts, offset) - 1
        index = bisect.bisect_right([d[0] for d in self._directives], line) - 1
        if index < 0:
            return f"<source>:{line + 1}"
        directive_line, number, name = self._directives[index]
        return f"{name}:{number + line - directive_line - 1}"
