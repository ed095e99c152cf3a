"""Synthetic benchmark workloads as token ids: random lengths, and groups sharing a long prefix.

Prompts are built from a pseudo-text corpus (common English words, tokenized once), so their
token statistics look like text; every prompt and output length is exact. Requests carry
their group and the length of the prefix they share with it, so the best possible prefix-cache
hit rate follows from the workload alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this "
    "be or has had one first their its new after who they have two been more other city year "
    "river world time people school game music team film war house story water history part "
    "state name light small large early north south common local human number public power "
    "answer question reason example problem result method simple careful question value"
).split()


@dataclass(frozen=True)
class BenchRequest:
    input_ids: list[int]
    output_len: int
    group: int = -1  # shared-prefix group, -1 for none
    shared_prefix_len: int = 0  # leading tokens shared with the rest of its group


class TextTokens:
    """Random windows of a tokenized pseudo-text corpus."""

    def __init__(self, tokenizer, num_words: int = 20000, seed: int = 0) -> None:
        rng = random.Random(seed)
        text = " ".join(rng.choice(WORDS) for _ in range(num_words))
        self.corpus: list[int] = tokenizer.encode(text, add_special_tokens=False)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.first_tokens = sorted({t for t in self.corpus if t not in special})

    def take(self, rng: random.Random, n: int) -> list[int]:
        """``n`` consecutive corpus tokens from a random offset (wrapping around)."""
        out: list[int] = []
        pos = rng.randrange(len(self.corpus))
        while len(out) < n:
            piece = self.corpus[pos : pos + n - len(out)]
            out += piece
            pos = 0
        return out


def random_requests(
    source: TextTokens,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """SGLang's ``random`` dataset: lengths drawn uniformly from ``[len * range_ratio, len]``."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        reqs.append(BenchRequest(source.take(rng, n_in), n_out))
    return reqs


def shared_prefix_requests(
    source: TextTokens,
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Groups of requests sharing a ``prefix_len``-token prefix (a few-shot block), each
    followed by its own ``question_len``-token question. Questions of a group start with
    distinct tokens, so nothing beyond the prefix is shared. Requests are interleaved across
    groups (request j of every group, then request j + 1), as independent users would send them."""
    if min(num_groups, prompts_per_group, prefix_len, question_len, output_len) < 1:
        raise ValueError("shared-prefix sizes (groups, prompts per group, lengths) must be >= 1")
    if max(num_groups, prompts_per_group) > len(source.first_tokens):
        raise ValueError(f"at most {len(source.first_tokens)} groups and prompts per group")
    rng = random.Random(seed)
    heads = rng.sample(source.first_tokens, num_groups)  # groups differ from their first token
    prefixes = [[h] + source.take(rng, prefix_len - 1) for h in heads]
    questions = []
    for _ in range(num_groups):
        firsts = rng.sample(source.first_tokens, prompts_per_group)
        questions.append([[f] + source.take(rng, question_len - 1) for f in firsts])
    return [
        BenchRequest(prefixes[g] + questions[g][j], output_len, g, prefix_len)
        for j in range(prompts_per_group)
        for g in range(num_groups)
    ]


def best_hit_rate(reqs: list[BenchRequest]) -> float:
    """The prefix-cache hit rate of an unbounded cache: every request after the first of its
    group reuses the group's shared prefix (never its own last prompt token), nothing else."""
    seen: set[int] = set()
    hits = 0
    for r in reqs:
        if r.group < 0:
            continue
        if r.group in seen:
            hits += min(r.shared_prefix_len, len(r.input_ids) - 1)
        seen.add(r.group)
    total = sum(len(r.input_ids) for r in reqs)
    return hits / total if total else 0.0


class RandomTokens:
    """Uniform random token ids in ``[low, vocab_size)``, with :class:`TextTokens`' interface:
    for models whose tokenizer does not encode the text corpus (random-weight benchmark models)."""

    def __init__(self, vocab_size: int, low: int = 2) -> None:
        if vocab_size <= low:
            raise ValueError(f"vocab_size must be > {low}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.low = low
        self.first_tokens = range(low, vocab_size)

    def take(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.low, self.vocab_size) for _ in range(n)]


def multiturn_turns(
    source: TextTokens | RandomTokens,
    num_conversations: int,
    num_rounds: int,
    turn_len: int,
    seed: int = 0,
) -> list[list[list[int]]]:
    """``turns[c][r]``: the ``turn_len`` new user tokens of conversation ``c`` in round ``r``.
    Conversations start with distinct tokens, so no two share a prefix."""
    if min(num_conversations, num_rounds, turn_len) < 1:
        raise ValueError("conversations, rounds and turn length must be >= 1")
    if num_conversations > len(source.first_tokens):
        raise ValueError(f"at most {len(source.first_tokens)} conversations")
    rng = random.Random(seed)
    heads = rng.sample(source.first_tokens, num_conversations)
    return [
        [([h] if r == 0 else []) + source.take(rng, turn_len - (r == 0)) for r in range(num_rounds)]
        for h in heads
    ]


def long_tailed_requests(
    source: TextTokens | RandomTokens,
    num_prompts: int,
    mean_input_len: int,
    mean_output_len: int,
    max_input_len: int,
    max_output_len: int,
    sigma: float = 1.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """ShareGPT-like lengths without the download: input and output lengths drawn from
    lognormal distributions with the given means and shape ``sigma`` (1.0: the median is 0.6 of
    the mean and one request in 50 is over 4x the mean, like chat logs), clipped to
    ``[1, max_*_len]``."""
    if min(num_prompts, mean_input_len, mean_output_len, max_input_len, max_output_len) < 1:
        raise ValueError("long-tailed dataset sizes and lengths must be >= 1")
    if not 0.0 < sigma <= 3.0:
        raise ValueError(f"--length-sigma must be in (0, 3], got {sigma}")
    rng = random.Random(seed)

    def draw(mean: int, cap: int) -> int:
        mu = math.log(mean) - sigma * sigma / 2  # lognormal mean = exp(mu + sigma^2 / 2)
        return min(max(1, round(rng.lognormvariate(mu, sigma))), cap)

    reqs = []
    for _ in range(num_prompts):
        n_in = draw(mean_input_len, max_input_len)
        reqs.append(BenchRequest(source.take(rng, n_in), draw(mean_output_len, max_output_len)))
    return reqs
