"""Drafters and a scheduler driver for the speculative-decoding tests.

The drafters are real implementations of the ``Drafter`` contract, each keeping a ledger that
checks how the scheduler calls it: ``observe`` only for a request with a proposal pending and
with the proposal's length, ``release`` exactly once per request it saw, nothing held when the
scheduler is idle.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step
from radixlm.srt.speculative import Draft, Drafter


class LedgerDrafter(Drafter):
    """Checks the calling contract; subclasses say what to propose (``draft_for``)."""

    name = "ledger"

    def __init__(self) -> None:
        self.pending: dict[Any, int] = {}  # rid -> length of the proposal awaiting observe
        self.seen: set[Any] = set()  # rids holding state (proposed, not released)
        self.released: list[Any] = []
        self.errors: list[str] = []
        self.num_proposed = 0
        self.num_accepted = 0

    def draft_for(self, req: Any, max_tokens: int) -> Draft:
        raise NotImplementedError

    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        out = []
        for req, n in zip(reqs, max_tokens, strict=True):
            if n <= 0:
                self.errors.append(f"asked for a draft of {n} tokens")
            self.seen.add(req.rid)
            draft = self.draft_for(req, n)
            assert len(draft) <= n
            if len(draft):
                self.pending[req.rid] = len(draft)
            out.append(draft)
        return out

    def observe(self, req: Any, num_proposed: int, num_accepted: int) -> None:
        expected = self.pending.pop(req.rid, None)
        if expected != num_proposed or not 0 <= num_accepted <= num_proposed:
            self.errors.append(f"observe({req.rid}, {num_proposed}, {num_accepted}): {expected}")
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted

    def release(self, req: Any) -> None:
        if req.rid not in self.seen:
            self.errors.append(f"release of {req.rid} that holds nothing")
        self.seen.discard(req.rid)
        self.pending.pop(req.rid, None)
        self.released.append(req.rid)

    def stats(self) -> dict[str, float]:
        return {"num_proposed": self.num_proposed, "num_accepted": self.num_accepted}

    def check_clean(self) -> None:
        assert not self.errors, self.errors
        assert not self.seen and not self.pending, (self.seen, self.pending)


class FixedDrafter(LedgerDrafter):
    """Always proposes the same tokens (a bad drafter: they are almost always rejected)."""

    name = "fixed"

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        self.tokens = tokens

    def draft_for(self, req: Any, max_tokens: int) -> Draft:
        return Draft(self.tokens[:max_tokens])


class OracleDrafter(LedgerDrafter):
    """Proposes a request's reference continuation (its plain greedy output, by prompt), with
    one token spoiled at a position that cycles through the draft: accepted runs of every
    length 0..k come up, and whole drafts are accepted every ``k + 1`` steps."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], spoil: bool = True) -> None:
        super().__init__()
        self.reference = reference
        self.spoil = spoil
        self.step = 0

    def draft_for(self, req: Any, max_tokens: int) -> Draft:
        ref = self.reference.get(tuple(req.prompt_ids), [])
        pos = len(req.output_ids)
        draft = list(ref[pos : pos + max_tokens])
        self.step += 1
        spoil = self.step % (max_tokens + 1)
        if self.spoil and spoil < len(draft):
            draft[spoil] = draft[spoil] + 1
        return Draft(draft)


class ProbDrafter(LedgerDrafter):
    """Draws each draft token from a distribution ``q`` that puts ``0.8`` on the reference
    continuation's token and spreads the rest over a few others (seeded by the request's
    sequence), and reports ``q``: sampled acceptance with a draft that is not one-hot."""

    name = "prob"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        super().__init__()
        self.reference = reference
        self.vocab_size = vocab_size

    def draft_for(self, req: Any, max_tokens: int) -> Draft:
        ref = self.reference.get(tuple(req.prompt_ids), [])
        pos = len(req.output_ids)
        want = ref[pos : pos + max_tokens]
        gen = torch.Generator().manual_seed(hash((tuple(req.prompt_ids), pos)) % 2**31)
        probs = torch.zeros(len(want), self.vocab_size)
        others = torch.randint(0, self.vocab_size, (len(want), 4), generator=gen)
        for j, tok in enumerate(want):
            probs[j, others[j]] += 0.05
            probs[j, tok] += 0.8
        probs /= probs.sum(dim=-1, keepdim=True)
        ids = torch.multinomial(probs, 1, generator=gen)[:, 0].tolist() if want else []
        return Draft(ids, probs)


def make_scheduler(
    model_dir, drafter: Drafter | None = None, algorithm: str = "ngram", **options
) -> Scheduler:
    """A scheduler on ``model_dir``; ``drafter`` replaces the configured one."""
    options = {"max_total_tokens": 4096, "log_level": "warning", **options}
    s = Scheduler(
        config_from_kwargs(model_path=str(model_dir), speculative_algorithm=algorithm, **options)
    )
    if drafter is not None:
        s.spec.drafter = drafter
    return s


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    reason: dict | None = None
    logprobs: list = field(default_factory=list)
    num_entries: int = 0  # outputs that carried tokens
    top: list = field(default_factory=list)  # output top-logprob rows
    id_rows: list = field(default_factory=list)  # output rows of token_ids_logprob
    input_lps: list | None = None  # input_token_logprobs, input_top_logprobs
    input_top: list | None = None
    input_id_rows: list | None = None  # input rows of token_ids_logprob


def _collect_logprobs(r: Result, out, i: int) -> None:
    if out.output_token_logprobs[i]:
        r.logprobs += out.output_token_logprobs[i]
    if out.output_top_logprobs[i]:
        r.top += out.output_top_logprobs[i]
    if out.input_token_logprobs[i] is not None:
        r.input_lps, r.input_top = out.input_token_logprobs[i], out.input_top_logprobs[i]
    if out.output_token_ids_logprobs and out.output_token_ids_logprobs[i]:
        r.id_rows += out.output_token_ids_logprobs[i]
    if out.input_token_ids_logprobs and out.input_token_ids_logprobs[i] is not None:
        r.input_id_rows = out.input_token_ids_logprobs[i]


def msg(
    rid: str,
    prompt: list[int],
    stream: bool = False,
    logprobs: int = -1,
    token_ids: list[int] | None = None,
    start: int = -1,
    **params,
):
    """A greedy request; ``logprobs`` >= 0 asks for logprobs with that many top ones (and the
    logprobs of ``token_ids``; input logprobs from ``start``)."""
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, **params}
    return TokenizedGenerateReq(
        rid=rid,
        input_ids=prompt,
        sampling_params=params,
        stream=stream,
        return_logprob=logprobs >= 0,
        logprob_start_len=start,
        top_logprobs_num=max(logprobs, 0),
        token_ids_logprob=token_ids,
    )


def drive(s: Scheduler, msgs=(), arrivals=None, hook=None, max_steps=5000) -> dict[str, Result]:
    """Steps until idle; ``arrivals`` maps a step number to messages handled before it."""
    for m in msgs:
        s.handle(m)
    arrivals = dict(arrivals or {})
    got: dict[str, Result] = {}
    for step in range(max_steps):
        for m in arrivals.pop(step, []):
            s.handle(m)
        if not s.has_work() and not arrivals:
            break
        if hook is not None:
            hook(s, step)
        out = run_step(s)
        for i, rid in enumerate(out.rids if out else []):
            r = got.setdefault(rid, Result())
            assert r.reason is None, f"{rid} reported after its finish"
            r.ids += out.new_token_ids[i]
            r.num_entries += bool(out.new_token_ids[i])
            _collect_logprobs(r, out, i)
            if out.finish_reason[i] is not None:
                r.reason = out.finish_reason[i]
    assert not s.has_work(), "the scheduler did not finish"
    return got


def check_idle(s: Scheduler) -> None:
    assert not s.has_work()
    u = s.kv.usage()
    assert u["available"] + u["evictable"] + u["protected"] == u["max_total_tokens"], u
    assert u["protected"] == 0, u
    assert s.check_idle()
    assert not s.spec.plans
    if isinstance(s.spec.drafter, LedgerDrafter):
        s.spec.drafter.check_clean()


def prompts(seed: int, num: int, length: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def repetitive_prompts(seed: int, num: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram drafter finds matches in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        phrase = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 9))]
        out.append([rng.randrange(100, 40000) for _ in range(3)] + phrase * 4)
    return out
