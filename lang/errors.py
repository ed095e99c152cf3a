"""The exception a failing program raises: it names the primitive and the variable involved."""

from __future__ import annotations


class ProgramError(RuntimeError):
    """A primitive (``gen``, ``select``, ``fork``, a role, ...) failed while a program ran.

    ``primitive`` is the primitive's name, ``name`` the variable it was filling (or None) and
    ``__cause__`` the original exception (a backend error, an HTTP error, a parse error).
    """

    def __init__(self, primitive: str, name: str | None, message: str) -> None:
        self.primitive = primitive
        self.name = name
        where = f"{primitive}({name!r})" if name is not None else f"{primitive}()"
        super().__init__(f"{where} failed: {message}")


class BackendError(RuntimeError):
    """A backend could not serve a request (HTTP status, server-side error, bad answer)."""
