"""``--log-requests``: one record per finished request, at SGLang's ``--log-requests-level``.

Levels (SGLang's): 0 metadata only (rid, finish reason, prompt / cached / completion tokens,
latency); 1 adds the sampling parameters that differ from their defaults; 2 adds the prompt
(its text, or its token ids when it came as ids) and the output text, each cut to
:data:`PARTIAL_CHARS` characters; 3 adds them whole. The default level is 0 here (SGLang's is 2)
so that turning request logs on never writes what users sent unless asked.

``--log-requests-format`` ``text`` writes one line per request, ``json`` one JSON object per
line. ``--log-requests-target`` takes ``stdout`` and/or folders (each gets a
``requests.log`` appended to); without it the records go to this module's logger at INFO.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from radixlm.srt.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

PARTIAL_CHARS = 2048  # level 2: the prompt and the output cut to this many characters each
FILE_NAME = "requests.log"
_DEFAULT_PARAMS = SamplingParams()


class RequestLog:
    def __init__(self, level: int = 0, fmt: str = "text", targets: tuple[str, ...] = ()):
        if level not in (0, 1, 2, 3):
            raise ValueError(f"log_requests_level must be 0, 1, 2 or 3, got {level}")
        if fmt not in ("text", "json"):
            raise ValueError(f"log_requests_format must be text or json, got {fmt!r}")
        self.level, self.fmt = level, fmt
        self._lock = threading.Lock()
        self._streams: list[TextIO] = []
        self._files: list[TextIO] = []
        for target in targets:
            if target == "stdout":
                self._streams.append(sys.stdout)
            else:
                folder = Path(target)
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    f = open(folder / FILE_NAME, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                except OSError as e:
                    self.close()
                    raise ValueError(
                        f"log_requests_target {target!r}: cannot append to {FILE_NAME} there ({e})"
                    ) from e
                self._files.append(f)
                self._streams.append(f)

    @classmethod
    def from_config(cls, cfg: Any) -> RequestLog | None:
        """The log a server config asks for (``--log-requests``), else None."""
        if not cfg.log_requests:
            return None
        return cls(cfg.log_requests_level, cfg.log_requests_format, cfg.log_requests_target or ())

    def record(
        self,
        rid: str,
        finish_reason: dict[str, Any] | None,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        latency_s: float,
        params: SamplingParams | None = None,
        prompt: str | list[int] | None = None,
        output: str = "",
    ) -> dict[str, Any]:
        """The record of one finished request at this log's level."""
        rec: dict[str, Any] = {
            "rid": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "completion_tokens": completion_tokens,
            "latency_s": round(latency_s, 4),
        }
        if self.level >= 1 and params is not None:
            rec["sampling_params"] = _non_default(params)
        if self.level >= 2:
            cut = PARTIAL_CHARS if self.level == 2 else None
            rec["prompt"] = _cut(prompt, cut)
            rec["output"] = _cut(output, cut)
        return rec

    def write(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, ensure_ascii=False) if self.fmt == "json" else _text(rec)
        if not self._streams:
            logger.info("%s", line)
            return
        with self._lock:
            for stream in self._streams:
                stream.write(line + "\n")
                stream.flush()

    def close(self) -> None:
        with self._lock:
            for f in self._files:
                f.close()
            self._files.clear()
            self._streams.clear()


def _non_default(params: SamplingParams) -> dict[str, Any]:
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(_DEFAULT_PARAMS, f.name)
    }


def _cut(value: str | list[int] | None, limit: int | None) -> str | list[int] | None:
    if value is None or limit is None or len(value) <= limit:
        return value
    return value[:limit]


def _text(rec: dict[str, Any]) -> str:
    reason = (rec["finish_reason"] or {}).get("type")
    line = (
        f"request {rec['rid']!r} finished ({reason}): prompt {rec['prompt_tokens']} tokens "
        f"({rec['cached_tokens']} cached), completion {rec['completion_tokens']}, "
        f"{rec['latency_s']:.3f} s"
    )
    if "sampling_params" in rec:
        line += f"; sampling params {json.dumps(rec['sampling_params'], ensure_ascii=False)}"
    if "prompt" in rec:
        line += f"; prompt {json.dumps(rec['prompt'], ensure_ascii=False)}"
        line += f"; output {json.dumps(rec['output'], ensure_ascii=False)}"
    return line
