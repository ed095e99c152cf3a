"""How ``select`` ranks its choices from token logprobs (not by constrained decoding).

A backend scores every choice by sending ``prefix + choice`` as a prefill-only request with
input-token logprobs from the end of the prefix; a method turns those per-token logprobs into
one score per choice and picks the best (the first one on a tie).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ChoiceLogprobs:
    """Per choice, the logprob of each of its tokens given the prefix; with
    ``unconditional`` also per choice the logprobs of its tokens with no context (the first
    token of a context-free prompt has none, so that list can be one shorter)."""

    conditional: list[list[float]]
    unconditional: list[list[float]] | None = None
    cached_tokens: list[int] | None = None  # per choice, as the server reported


@dataclass(frozen=True)
class SelectResult:
    decision: str
    index: int
    scores: list[float]
    meta_info: dict[str, Any] = field(default_factory=dict)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


class ChoicesMethod:
    """Base of the ranking methods; subclasses define :meth:`scores` or :meth:`pick`."""

    name = "base"
    needs_unconditional = False

    def scores(self, logprobs: ChoiceLogprobs) -> list[float]:
        raise NotImplementedError

    def pick(self, logprobs: ChoiceLogprobs, scores: list[float]) -> int:
        return _argmax(scores)

    def __call__(self, choices: list[str], logprobs: ChoiceLogprobs) -> SelectResult:
        if len(logprobs.conditional) != len(choices):
            raise ValueError(
                f"got logprobs for {len(logprobs.conditional)} of {len(choices)} choices"
            )
        scores = self.scores(logprobs)
        index = self.pick(logprobs, scores)
        meta = {
            "choices_method": self.name,
            "normalized_prompt_logprobs": scores,
            "input_token_logprobs": logprobs.conditional,
            "unconditional_token_logprobs": logprobs.unconditional,
            "cached_tokens": logprobs.cached_tokens,
        }
        return SelectResult(choices[index], index, scores, meta)

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    """The mean logprob of the choice's tokens (SGLang's default)."""

    name = "token_length_normalized"

    def scores(self, logprobs: ChoiceLogprobs) -> list[float]:
        return [_mean(lps) for lps in logprobs.conditional]


class GreedyToken(ChoicesMethod):
    """What greedy decoding would pick: the best first token; choices that tie on it (they share
    it) are separated by their next tokens. A choice that ran out of tokens continues with its
    mean logprob. Scores are the first-token logprobs."""

    name = "greedy_token"

    def scores(self, logprobs: ChoiceLogprobs) -> list[float]:
        return [lps[0] if lps else float("-inf") for lps in logprobs.conditional]

    def pick(self, logprobs: ChoiceLogprobs, scores: list[float]) -> int:
        seqs = logprobs.conditional
        alive = list(range(len(seqs)))
        for pos in range(max(len(s) for s in seqs)):
            at = {i: seqs[i][pos] if pos < len(seqs[i]) else _mean(seqs[i]) for i in alive}
            best = max(at.values())
            alive = [i for i in alive if at[i] >= best - TIE_TOLERANCE]
            if len(alive) == 1:
                break
        return alive[0]


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """(sum of the choice's logprobs given the prefix - sum given no context) / its length:
    how much the prefix raises the choice above its prior likelihood."""

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def scores(self, logprobs: ChoiceLogprobs) -> list[float]:
        if logprobs.unconditional is None:
            raise ValueError(f"{self.name} needs the unconditional logprobs of every choice")
        return [
            (sum(cond) - sum(uncond)) / len(cond) if cond else float("-inf")
            for cond, uncond in zip(logprobs.conditional, logprobs.unconditional, strict=True)
        ]


token_length_normalized = TokenLengthNormalized()
greedy_token = GreedyToken()
greedy_token_selection = greedy_token
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

METHODS: dict[str, ChoicesMethod] = {
    m.name: m for m in (token_length_normalized, greedy_token, unconditional_likelihood_normalized)
}
METHODS["greedy_token_selection"] = greedy_token


def resolve_method(method: ChoicesMethod | str) -> ChoicesMethod:
    if isinstance(method, ChoicesMethod):
        return method
    if isinstance(method, str) and method in METHODS:
        return METHODS[method]
    raise ValueError(
        f"choices_method must be one of {sorted(METHODS)} (or a ChoicesMethod), got {method!r}"
    )
