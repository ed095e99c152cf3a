"""Finish checks after each new token: stop token ids, EOS, stop strings, length limits."""

from __future__ import annotations

from radixlm.srt.scheduler.req import Req

STOP_STR_WINDOW_EXTRA_TOKENS = 4


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length

    def suppressed_ids(self, req: Req) -> list[int]:
        """Token ids that may not be sampled yet (EOS and stop ids before min_new_tokens)."""
        if len(req.output_ids) >= req.params.min_new_tokens:
            return []
        ids = set(req.params.stop_token_ids or [])
        if not req.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def check(self, req: Req) -> None:
        """Sets ``req.finish_reason`` if the token just appended ends the request."""
        p = req.params
        num_out = len(req.output_ids)
        last = req.output_ids[-1]
        if num_out >= p.min_new_tokens:
            if last in (p.stop_token_ids or ()) or (
                not p.ignore_eos and last in self.eos_token_ids
            ):
                req.finish({"type": "stop", "matched": last})
                return
            matched = self._matched_stop_str(req)
            if matched is not None:
                req.finish({"type": "stop", "matched": matched})
                return
        if num_out >= p.max_new_tokens:
            req.finish({"type": "length", "length": p.max_new_tokens})
        elif req.seq_len >= self.context_length:
            req.finish({"type": "length", "length": num_out})

    def _matched_stop_str(self, req: Req) -> str | None:
        stops = req.params.stop_strs
        if not stops:
            return None
        window = max(len(s) for s in stops) + STOP_STR_WINDOW_EXTRA_TOKENS
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        for s in stops:
            if s in tail:
                return s
        return None
