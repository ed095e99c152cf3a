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
        """Linear in what it consumes: only the text up to the marker is copied, never the
        rest of ``text`` (a text of many markers is scanned once, not once per marker)."""
        held, marker = self._held, self.marker
        found = self._find(text, pos)
        if found >= 0:
            after = found + len(marker)  # in held + text[pos:]
            s = held + text[pos : pos + after - len(held)]
            start = whitespace_start(s, found, self._ws_limit)
            self._held = ""
            return s[:start], s[start:after], pos + after - len(held)
        s = held + text[pos:]  # all of it is consumed: shown or held
        keep = whitespace_start(s, len(s) - partial_suffix(s, marker), self._ws_limit)
        self._held = s[keep:]
        return s[:keep], "", None

    def _find(self, text: str, pos: int) -> int:
        """Where the marker starts in ``held + text[pos:]`` (-1: nowhere), without building
        that string: one that starts in the held part ends within ``len(marker) - 1``
        characters of ``pos``."""
        held, marker = self._held, self.marker
        if held:
            found = (held + text[pos : pos + len(marker) - 1]).find(marker)
            if found >= 0:
                return found
        found = text.find(marker, pos)
        return found - pos + len(held) if found >= 0 else -1

    def flush(self) -> str:
        """End of input: what is held back (whitespace, a partial marker)."""
        held, self._held = self._held, ""
        return held
