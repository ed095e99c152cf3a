"""Finding a marker (``<tool_call>``, ``</think>``) in streamed text with a bounded hold-back."""

from __future__ import annotations

WHITESPACE = " \t\n\r"
WS_HOLD = 64  # whitespace held right before a possible marker (dropped when one follows)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def whitespace_start(text: str, end: int, limit: int = WS_HOLD) -> int:
    """Start of the whitespace run that ends at ``end`` (at most ``limit`` characters)."""
    start = end
    while start > 0 and end - start < limit and text[start - 1] in WHITESPACE:
        start -= 1
    return start


class MarkerSplitter:
    """Splits streamed text at the first occurrence of ``marker``.

    ``scan`` returns ``(before, marker_text, index)``: ``before`` is text that is certainly not
    part of the marker; when the marker is found, ``marker_text`` is the marker with the
    whitespace right before it (at most ``WS_HOLD`` characters: markup, whose fate the caller
    decides) and ``index`` is where the text after the marker starts in the scanned piece,
    else ``("", None)``. Held back between calls: the whitespace and a suffix that may begin
    the marker, at most ``WS_HOLD + len(marker) - 1`` characters.
    """

    def __init__(self, marker: str, strip_whitespace: bool = True) -> None:
        self.marker = marker
        self._ws_limit = WS_HOLD if strip_whitespace else 0
        self._held = ""

    def scan(self, text: str, pos: int = 0) -> tuple[str, str, int | None]:
        held = self._held
        s = held + text[pos:]
        found = s.find(self.marker)
        if found >= 0:
            start = whitespace_start(s, found, self._ws_limit)
            self._held = ""
            after = found + len(self.marker)
            return s[:start], s[start:after], pos + after - len(held)
        keep = whitespace_start(s, len(s) - partial_suffix(s, self.marker), self._ws_limit)
        self._held = s[keep:]
        return s[:keep], "", None

    def flush(self) -> str:
        """End of input: what is held back (whitespace, a partial marker)."""
        held, self._held = self._held, ""
        return held
