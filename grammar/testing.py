"""Small factories for grammar tests (and for scheduler tests that need a real tokenizer).

``train_byte_level_tokenizer`` trains a tiny byte-level BPE tokenizer offline (no hub access) and
wraps it in ``transformers.PreTrainedTokenizerFast``; ``random_walk`` drives a matcher with
uniformly sampled allowed tokens, checking on the way that the mask and the matcher agree.
"""

from __future__ import annotations

import random
from functools import lru_cache

from radixlm.grammar.base import GrammarMatcher
from radixlm.grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from radixlm.grammar.vocab import TokenizerVocab

EOS_TOKEN = "<|endoftext|>"
_WORDS = (
    "name age email city street zip country phone date time color red green blue id value "
    "true false null items tags user admin alice bob carol dave example test data json "
    "quick brown fox jumps over lazy dog hello world answer yes no maybe"
).split()


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = rng.sample(_WORDS, 4)
        number = rng.randint(0, 99999)
        date = f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        colour = "#" + "".join(rng.choice("0123456789abcdef") for _ in range(6))
        lines.append(
            f'{{"{words[0]}": "{words[1]} {words[2]}", "{words[3]}": {number}, "ok": true}} '
            f"{words[0]}@{words[1]}.com {date} {colour} [{number}, {rng.random():.3f}]"
        )
    return lines


@lru_cache(maxsize=4)
def train_byte_level_tokenizer(vocab_size: int = 500, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as its EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(600, seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)


def random_walk(
    matcher: GrammarMatcher,
    vocab: TokenizerVocab,
    rng: random.Random,
    max_tokens: int = 400,
    eos_probability: float = 0.0,
    check_rejections: bool = True,
    closers: frozenset[int] = frozenset(),
) -> tuple[list[int], bool]:
    """Samples allowed tokens uniformly until the matcher accepts EOS.

    Returns the generated ids (EOS excluded) and whether EOS was reached. ``eos_probability``
    picks EOS directly, when allowed, with that probability (to bound unbounded grammars). With
    ``check_rejections``, one random masked-out token per step is offered and must be rejected
    (exact for DFA backends; llguidance masks out non-canonical tokenizations of forced text
    that ``accept_token`` still accepts). With ``closers``, a step that does not take EOS
    takes one of them (when allowed) with a probability growing from 0.25 to 0.75 over 200
    steps (``closing_walk``).
    """
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    eos = set(vocab.eos_token_ids)
    generated: list[int] = []
    for step in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask, 0, vocab.vocab_size)
        assert allowed, f"dead end after {vocab.decode_bytes(generated)!r}"
        if check_rejections:
            _check_rejects_disallowed(matcher, allowed, vocab.vocab_size, rng)
        allowed_eos = [t for t in allowed if t in eos]
        allowed_closers = [t for t in allowed if t in closers] if closers else []
        draw = rng.random() if allowed_eos or allowed_closers else 1.0
        if allowed_eos and draw < eos_probability:
            token = rng.choice(allowed_eos)
        elif allowed_closers and draw < 0.25 + min(0.5, step / 400):
            token = rng.choice(allowed_closers)
        else:
            token = rng.choice(allowed)
        assert matcher.accept_token(token), f"masked-in token {token} was rejected"
        if matcher.is_terminated():
            return generated, True
        generated.append(token)
    return generated, False


def _check_rejects_disallowed(
    matcher: GrammarMatcher, allowed: list[int], vocab_size: int, rng: random.Random
) -> None:
    if len(allowed) == vocab_size:
        return
    allowed_set = set(allowed)
    while True:
        candidate = rng.randrange(vocab_size)
        if candidate not in allowed_set:
            break
    before = matcher.num_accepted_tokens
    assert not matcher.accept_token(candidate), f"masked-out token {candidate} was accepted"
    assert matcher.num_accepted_tokens == before


def closing_tokens(vocab: TokenizerVocab, closers: bytes = b'"]},') -> frozenset[int]:
    """The tokens made only of ``closers`` bytes: what ends a JSON string, array or object."""
    found = set()
    for token in range(vocab.vocab_size):
        text = vocab.decode_bytes([token])
        if text and all(byte in closers for byte in text):
            found.add(token)
    return frozenset(found)


def closing_walk(
    matcher: GrammarMatcher,
    vocab: TokenizerVocab,
    rng: random.Random,
    closers: frozenset[int],
    max_tokens: int = 1500,
) -> tuple[list[int], bool]:
    """A ``random_walk`` that ends: EOS is taken half the time it is allowed, and a
    ``closers`` token (``closing_tokens``) more and more often as the walk grows (a uniform walk
    over an unbounded string meets its closing quote once in ``vocab_size`` steps)."""
    return random_walk(matcher, vocab, rng, max_tokens, 0.5, False, closers)
