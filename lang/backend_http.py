"""Programs over HTTP, speaking the native API (``/generate``, ``/get_model_info``,
``/flush_cache``) of a radixlm server, or of an SGLang server.

    rl.set_default_backend(rl.RuntimeEndpoint("http://127.0.0.1:30000"))
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import requests

from radixlm.lang.backend_base import (
    BOUNDARY_TOKENS,
    BaseBackend,
    Prompt,
    common_prefix_len,
    logprob_values,
)
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoiceLogprobs
from radixlm.lang.errors import BackendError
from radixlm.lang.ir import GenParams

PREFILL_ONLY = {"max_new_tokens": 0}


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return response.text[:500]


class RuntimeEndpoint(BaseBackend):
    """A server at ``base_url``. The chat template comes from the server's tokenizer when its
    folder is readable here, else ChatML (or pass ``chat_template``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._local = threading.local()
        self.model_info = self._get("/get_model_info")
        self.chat_template = chat_template or self._load_chat_template()
        self.is_cache_enabled = not self._server_info().get("disable_radix_cache", False)

    # ------------------------------------------------------------------ HTTP
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self.headers)
        return session

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        url = self.base_url + path
        try:
            r = self._session().request(method, url, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as e:
            raise BackendError(f"cannot reach {url}: {e}") from e
        if r.status_code != 200:
            raise BackendError(f"HTTP {r.status_code} from {path}: {_error_message(r)}")
        return r

    def _get(self, path: str) -> Any:
        return self._request("GET", path).json()

    def _generate(self, body: dict[str, Any]) -> Any:
        out = self._request("POST", "/generate", json=body).json()
        for item in out if isinstance(out, list) else [out]:
            self.usage.add_meta(item["meta_info"])
        return out

    def _server_info(self) -> dict[str, Any]:
        try:
            return self._get("/get_server_info")
        except BackendError:
            return {}

    def _load_chat_template(self) -> ChatTemplate:
        path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if not path or not os.path.isdir(path):
            return ChatTemplate.chatml()
        from transformers import AutoTokenizer

        return ChatTemplate.from_tokenizer(AutoTokenizer.from_pretrained(path))

    # ------------------------------------------------------------------ backend
    def cache_prefix(self, prompt: Prompt) -> None:
        if self.is_cache_enabled and prompt.text:
            self._generate({"text": prompt.text, "sampling_params": PREFILL_ONLY})

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        body = {"text": prompt.text, "sampling_params": params.to_sampling_params()}
        out = self._generate({**body, **params.request_options()})
        return out["text"], out["meta_info"]

    def generate_stream(
        self, prompt: Prompt, params: GenParams
    ) -> Iterator[tuple[str, dict | None]]:
        body = {
            "text": prompt.text,
            "sampling_params": params.to_sampling_params(),
            "stream": True,
            **params.request_options(),
        }
        r = self._request("POST", "/generate", json=body, stream=True)
        sent, meta = 0, None
        with r:
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    raise BackendError(
                        f"the server stopped the stream: {event['error'].get('message')}"
                    )
                text, meta = event["text"], event["meta_info"]
                if len(text) > sent:
                    yield text[sent:], None
                    sent = len(text)
        if meta is None:
            raise BackendError("the stream from /generate ended without a result")
        self.usage.add_meta(meta)
        yield "", meta

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceLogprobs:
        """Prefix prefill (its token count N), then one batch of [prefix, prefix + choice...]
        scored from N - BOUNDARY_TOKENS: the prefix's own tail ids show where each choice's
        tokens begin, even when its first token merged with the prefix's last ones."""
        num_prefix = self._generate({"text": prompt.text, "sampling_params": PREFILL_ONLY})[
            "meta_info"
        ]["prompt_tokens"]
        first = max(1, num_prefix - BOUNDARY_TOKENS)
        texts = [prompt.text] + [prompt.text + c for c in choices]
        outs = self._generate(
            {
                "text": texts,
                "sampling_params": [PREFILL_ONLY] * len(texts),
                "return_logprob": True,
                "logprob_start_len": first,
            }
        )
        entries = [out["meta_info"]["input_token_logprobs"] for out in outs]
        tail_ids = [e[1] for e in entries[0]]
        conditional = []
        for row in entries[1:]:
            start = common_prefix_len(tail_ids, [e[1] for e in row])
            start = min(start, len(row) - 1)
            conditional.append(logprob_values(row[start:]))
        uncond = self._unconditional(choices) if unconditional else None
        cached = [out["meta_info"].get("cached_tokens", 0) for out in outs[1:]]
        return ChoiceLogprobs(conditional, uncond, cached)

    def _unconditional(self, choices: list[str]) -> list[list[float]]:
        outs = self._generate(
            {
                "text": list(choices),
                "sampling_params": [PREFILL_ONLY] * len(choices),
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        )
        return [logprob_values(out["meta_info"]["input_token_logprobs"]) for out in outs]

    def flush_cache(self) -> bool:
        try:
            self._request("POST", "/flush_cache")
        except BackendError:
            return False
        return True

    def get_model_info(self) -> dict[str, Any]:
        return dict(self.model_info)

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
