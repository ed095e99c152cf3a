"""Client-chosen names (rids, session ids) in the namespace of their caller.

A rid or a session id that a client picks is a key in state every caller shares (the rid
registry of request_front.py, the open sessions of sessions.py). Kept as the client sent it,
one caller could abort another's request, hold its rid so its next request is refused, or
read, close and probe its sessions. So the key is the name joined to the caller's namespace
(``scoped``): the HTTP routes derive the namespace from the API key, or from the ``user`` field
where no key is set (server/http/deps.py ``caller_namespace``); the Engine's single caller has
the empty namespace, so its keys are its names, unchanged. Answers show the client's name only.
"""

from __future__ import annotations

__all__ = ["client_name", "scoped"]

SEPARATOR = "\n"  # never in a name the HTTP routes accept (visible ASCII only)


def scoped(namespace: str, name: str) -> str:
    """The key of ``name`` in ``namespace`` (the name itself in the empty namespace)."""
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def client_name(key: str) -> str:
    """The name a key was made from, as its caller sent it (for messages)."""
    namespace, sep, name = key.partition(SEPARATOR)
    return name if sep and namespace else key
