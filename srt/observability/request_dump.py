"""The request dump (``--dump-requests-dir``): one JSON line per HTTP generate call, for replay
(``python -m radixlm.srt.bench.replay``).

A line: ``{"v": 1, "route", "method", "arrival_time" (Unix seconds), "headers" (secrets
redacted), "body" (the JSON body, secrets redacted), "status", "latency_s", "sequences": [{"rid",
"output_ids", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_s"
(null when the client did not stream), "e2e_s"}]}``. Files are ``requests.jsonl`` and, after
rotation, ``requests.1.jsonl`` (older) up to ``requests.{NUM_FILES - 1}.jsonl``; a file rotates
when it passes a quarter of the bound, so the folder never holds much more than the bound.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import orjson

DUMP_VERSION = 1
NUM_FILES = 4
CURRENT_FILE = "requests.jsonl"
REDACTED = "[redacted]"
# header names (lowercase) and body keys whose values never reach the dump
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie"}
)
SECRET_KEYS = frozenset(
    {"api_key", "apikey", "authorization", "password", "secret", "access_token", "token"}
)


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def redact(value: Any) -> Any:
    """``value`` with the values of secret-named keys replaced, at any depth."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if str(k).lower() in SECRET_KEYS else redact(v)) for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def dump_files(folder: str | Path) -> list[Path]:
    """The folder's dump files, oldest first."""
    d = Path(folder)
    older = [d / f"requests.{i}.jsonl" for i in range(NUM_FILES - 1, 0, -1)]
    return [p for p in (*older, d / CURRENT_FILE) if p.exists()]


class RequestDump:
    """Appends records to the current file; thread-safe."""

    def __init__(self, folder: str | Path, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file_bytes = max(max_bytes // NUM_FILES, 1)
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = orjson.dumps({"v": DUMP_VERSION, **record}) + b"\n"
        with self.lock:
            path = self.folder / CURRENT_FILE
            with open(path, "ab") as f:
                f.write(line)
                size = f.tell()
            if size >= self.file_bytes:
                self._rotate()

    def _rotate(self) -> None:
        for i in range(NUM_FILES - 1, 0, -1):
            src = self.folder / (CURRENT_FILE if i == 1 else f"requests.{i - 1}.jsonl")
            if src.exists():
                os.replace(src, self.folder / f"requests.{i}.jsonl")
