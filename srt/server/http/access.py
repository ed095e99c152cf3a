"""Who may call the admin routes, what a non-admin caller may see, and the browser guard.

The one list of admin routes is ``config.ADMIN_ROUTES`` (the ``--help`` of the key flags and
docs/operations/production.md's table are checked against it). With ``--admin-api-key`` every
admin route needs that key (the API key gets 403). Without it:

- ``/flush_cache`` and ``abort_all`` take the API key (checked by the key middleware), or
  nothing on a server without keys;
- the admin verbs (``config.ADMIN_VERBS``: weight updates and reads, pause and continue,
  profiling, the weight version) are off (403) unless ``--enable-admin-verbs-with-api-key``
  serves them to the ordinary key; a server without any key on a loopback bind keeps serving
  them, for local use (a web page cannot reach it: the Host allow-list and the browser guard).

Browser guard: a web page can send a cross-origin POST without a CORS preflight only with a
form or text body or none at all, and a GET through an image; the admin routes therefore take
only JSON bodies (``parse_body``) and refuse a request without one that carries a browser's
marks (``Origin``, or ``Sec-Fetch-Site`` naming another site). Clients outside browsers
(sglang-router's body-less ``/flush_cache``, SGLang's ``RuntimeEndpoint``) send neither.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import Request

from radixlm.srt.config import (
    ADMIN_ROUTES,
    ADMIN_VERBS,
    KV_CACHE_SCALE_MODES,
    ServerConfig,
    is_loopback_host,
)
from radixlm.srt.managers.tokenizer_manager import GenerateError

logger = logging.getLogger(__name__)

IS_VERB = dict(ADMIN_ROUTES)  # route -> whether it is one of the admin verbs
BROWSER_SITES = ("cross-site", "same-site")  # Sec-Fetch-Site of a request another page made
REDACTED = "<redacted>"
# fields of /server_info and /model_info that hold local paths (their values are hidden from
# callers who are not admins); model_path and tokenizer_path show the served name instead
PATH_FIELDS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "chat_template",
        "hicache_storage_dir",
        "grammar_cache_dir",
        "speculative_draft_model_path",
        "kv_cache_scales",
        "torch_profiler_dir",
        "weight_update_roots",
    }
)
NAME_FIELDS = ("model_path", "tokenizer_path")


def bearer_token(headers: Any) -> bytes:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key: <key>`` (what
    Anthropic's clients send)."""
    if not isinstance(headers, dict):
        return b""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return headers.get(b"x-api-key", b"").strip()


def matches(token: bytes, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(token, key.encode())


def _token(request: Request) -> bytes:
    return bearer_token(dict(request.scope.get("headers") or []))


def admin_verbs_open(cfg: ServerConfig) -> bool:
    """Whether the admin verbs are served without the admin key (see the module docstring)."""
    if cfg.enable_admin_verbs_with_api_key:
        return True
    return cfg.api_key is None and is_loopback_host(cfg.host)


def require_admin(request: Request) -> None:
    """Raises GenerateError (401, 403, 415) unless the request may use this admin route."""
    path = request.url.path
    assert path in IS_VERB, f"{path} calls require_admin but is not in config.ADMIN_ROUTES"
    check_not_from_browser(request)
    cfg: ServerConfig = request.app.state.tm.cfg
    token = _token(request)
    if cfg.admin_api_key is not None:
        if matches(token, cfg.admin_api_key):
            return
        if token and matches(token, cfg.api_key):
            raise GenerateError(
                "this route needs the admin API key (--admin-api-key)",
                403,
                code="admin_key_required",
            )
        raise GenerateError(
            "this route needs the admin API key: send Authorization: Bearer <admin key>",
            401,
            code="invalid_api_key",
        )
    if IS_VERB[path] and not admin_verbs_open(cfg):
        raise GenerateError(
            f"{path} is an admin verb, off on this server: start it with --admin-api-key (and "
            "send that key), or with --enable-admin-verbs-with-api-key",
            403,
            code="admin_verbs_disabled",
        )


def check_not_from_browser(request: Request) -> None:
    """415 for an admin request a web page could have sent cross-origin: a body that is not
    JSON, or no body with a browser's marks (``Origin``, a foreign ``Sec-Fetch-Site``)."""
    raw = request.headers.get("content-type")
    media = (raw or "").split(";", 1)[0].strip().lower()
    if media == "application/json":
        return
    from_browser = "origin" in request.headers or (
        request.headers.get("sec-fetch-site", "").lower() in BROWSER_SITES
    )
    if raw or from_browser:
        raise GenerateError(
            "admin routes take Content-Type: application/json (a web page cannot send that "
            f"cross-origin); got {repr(raw) if raw else 'none, from a browser'}",
            415,
            code="unsupported_media_type",
        )


def is_admin_caller(request: Request) -> bool:
    """Whether the caller may see local paths: it sent the admin key, or there is none and it
    may use the admin verbs (a server without keys: everyone; with the API key and
    ``--enable-admin-verbs-with-api-key``: its holders, whom the key middleware checked)."""
    cfg: ServerConfig = request.app.state.tm.cfg
    if cfg.admin_api_key is not None:
        return matches(_token(request), cfg.admin_api_key)
    return cfg.api_key is None or cfg.enable_admin_verbs_with_api_key


def redact_paths(answer: dict[str, Any], served_model_name: str) -> dict[str, Any]:
    """``answer`` with the values of PATH_FIELDS hidden, at any depth (the fields stay: SGLang
    clients read ``model_path``, which shows the served name)."""

    def hide(key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: hide(k, v) for k, v in value.items()}
        if isinstance(value, list):
            return [hide(key, v) for v in value]
        if key not in PATH_FIELDS or not isinstance(value, str):
            return value
        if key in NAME_FIELDS:
            return served_model_name
        if key == "kv_cache_scales" and value in KV_CACHE_SCALE_MODES:
            return value
        if key == "chat_template" and ("{{" in value or "{%" in value):
            return value  # the template text, not a file's path
        return REDACTED

    return {k: hide(k, v) for k, v in answer.items()}


def access_warnings(cfg: ServerConfig) -> list[str]:
    """What start-up logs about the keys: who holds the admin verbs when no admin key does,
    and an open server on a non-loopback bind."""
    verbs = ", ".join(ADMIN_VERBS)
    loopback = is_loopback_host(cfg.host)
    out = []
    if cfg.admin_api_key is None and cfg.enable_admin_verbs_with_api_key:
        who = "every --api-key holder" if cfg.api_key else "anyone who reaches the port"
        out.append(
            f"--enable-admin-verbs-with-api-key: {who} may update and read the weights, pause "
            f"generation and write profiles ({verbs}); give --admin-api-key instead"
        )
    elif cfg.admin_api_key is None and (cfg.api_key or not loopback):
        out.append(
            f"the admin verbs ({verbs}) are off: no --admin-api-key (turn them on with "
            "--admin-api-key, or --enable-admin-verbs-with-api-key)"
        )
    if cfg.api_key is None and cfg.admin_api_key is None and not loopback:
        out.append(
            f"no --api-key on host {cfg.host}: every route is open to whoever reaches the port"
        )
    return out


def log_access_warnings(cfg: ServerConfig) -> None:
    for line in access_warnings(cfg):
        logger.warning("%s", line)
