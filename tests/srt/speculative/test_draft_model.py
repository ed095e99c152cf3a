"""The draft-model drafter on tiny random models (CPU): greedy drafts are the draft model's own
greedy continuation (checked against transformers), sampled drafts come with their
distributions, and propose / observe / release keep the draft KV pool's accounting exact."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.srt.config import ServerConfig
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.speculative import make_drafter
from radixlm.srt.speculative.draft_model import DraftModelDrafter

K = 4


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_model_writer, tokenizer):
    """A second random model over the same tokenizer, of another shape (other weights)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    return tiny_model_writer(path, tokenizer, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def target_cfg(tiny_llama_dir):
    return ServerConfig(
        model_path=str(tiny_llama_dir),
        device="cpu",
        max_total_tokens=1024,
        max_running_requests=6,
        speculative_num_draft_tokens=K,
        log_level="warning",
    )


@pytest.fixture(scope="module")
def target(target_cfg):
    return ModelRunner(target_cfg)


def _spec_cfg(target_cfg, draft_dir, **changes):
    return target_cfg.replace(
        speculative_algorithm="draft", speculative_draft_model_path=str(draft_dir), **changes
    )


@pytest.fixture(scope="module")
def drafter(target_cfg, target, draft_dir):
    d = make_drafter(
        _spec_cfg(target_cfg, draft_dir, speculative_disable_adaptive=True), target, None
    )
    assert isinstance(d, DraftModelDrafter) and d.name == "draft"
    yield d
    assert d.num_tracked() == 0, "a test left draft state behind"
    d.close()


@pytest.fixture(scope="module")
def hf_draft(draft_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(draft_dir, torch_dtype=torch.float32).eval()


def _hf_greedy(hf, tokens: list[int], num: int) -> list[int]:
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(num):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens) :]


def _check_pool(d: DraftModelDrafter) -> None:
    d.allocator.collect_freed()
    assert d.allocator.available_size() + d.num_held_slots() == d.allocator.max_total_tokens
    assert d.table.available_size() + d.num_tracked() == d.table.num_req_slots
    for state in d._states.values():
        assert state.num_slots == len(state.kv_tokens)


def _verify(req, draft: list[int], rng: random.Random) -> int:
    """A stand-in for the target: accept a random prefix, then append one token of its own."""
    accepted = rng.randint(0, len(draft))
    req.output_ids += draft[:accepted] + [rng.randrange(1000)]
    return accepted


@pytest.mark.slow
def test_greedy_drafts_are_the_draft_models_greedy_continuation(drafter, hf_draft, make_req):
    rng = random.Random(0)
    reqs = [make_req([rng.randrange(1000) for _ in range(n)]) for n in (5, 17, 9)]
    for _ in range(6):
        drafts = drafter.propose(reqs, [K, 2, K])
        for req, draft, k in zip(reqs, drafts, [K, 2, K], strict=True):
            assert draft.probs is None and len(draft) == k
            assert draft.token_ids == _hf_greedy(hf_draft, req.tokens, k)
            drafter.observe(req, k, _verify(req, draft.token_ids, rng))
        _check_pool(drafter)
    for req in reqs:
        drafter.release(req)
    _check_pool(drafter)
    assert drafter.num_held_slots() == 0


def test_skipped_observe_and_edits_resync(drafter, hf_draft, make_req):
    req = make_req(list(range(100, 112)))
    (draft,) = drafter.propose([req], [K])
    req.output_ids += draft.token_ids[:2]  # no observe: the next propose finds out by itself
    (draft,) = drafter.propose([req], [K])
    assert draft.token_ids == _hf_greedy(hf_draft, req.tokens, K)
    req.output_ids = [7, 8]  # an edit replaced the output
    (draft,) = drafter.propose([req], [K])
    assert draft.token_ids == _hf_greedy(hf_draft, req.tokens, K)
    _check_pool(drafter)
    drafter.release(req)
    _check_pool(drafter)


def test_sampled_drafts_return_their_distributions(drafter, make_req):
    params = SamplingParams(temperature=0.8, top_k=50)
    reqs = [
        make_req([5, 6, 7, 8], params=params, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    drafts = drafter.propose(reqs, [K, K])
    assert drafts[0].token_ids == drafts[1].token_ids  # same seed, same prompt
    for draft in drafts:
        assert draft.probs is not None and draft.probs.shape == (K, drafter.vocab_size)
        torch.testing.assert_close(draft.probs.sum(dim=-1), torch.ones(K))
        assert int((draft.probs > 0).sum(dim=-1).max()) <= 50  # top-k applied
        chosen = draft.probs[torch.arange(K), torch.tensor(draft.token_ids)]
        assert bool((chosen > 0).all())
    torch.testing.assert_close(drafts[0].probs, drafts[1].probs)
    for req in reqs:
        drafter.observe(req, K, 1)
        drafter.release(req)
    _check_pool(drafter)


def test_random_traffic_keeps_the_pool_exact(drafter, make_req):
    rng = random.Random(1)
    live = []
    for _ in range(25):
        if len(live) < 5 and rng.random() < 0.5:
            live.append(make_req([rng.randrange(1000) for _ in range(rng.randrange(1, 40))]))
        if live and rng.random() < 0.2:
            drafter.release(live.pop(rng.randrange(len(live))))
        limits = [rng.randrange(0, K + 1) for _ in live]
        drafts = drafter.propose(live, limits)
        for req, draft, k in zip(live, drafts, limits, strict=True):
            assert len(draft) <= k
            if draft.token_ids and rng.random() < 0.8:
                drafter.observe(req, len(draft), _verify(req, draft.token_ids, rng))
            else:
                req.output_ids.append(rng.randrange(1000))
        _check_pool(drafter)
    for req in live:
        drafter.release(req)
    _check_pool(drafter)
    assert drafter.num_held_slots() == 0


def test_long_prompts_catch_up_over_several_steps(target, draft_dir, target_cfg, make_req):
    d = DraftModelDrafter.from_config(_spec_cfg(target_cfg, draft_dir), target)
    d.max_catchup_tokens = 8
    req = make_req(list(range(200, 220)))  # 20 tokens: 8 + 8 + 4
    assert [len(d.propose([req], [K])[0]) for _ in range(3)] == [0, 0, K]
    _check_pool(d)
    d.close()
    assert d.num_tracked() == 0


def test_requests_past_the_draft_context_get_no_draft(drafter, make_req):
    req = make_req([1] * (drafter.context_length - 2))
    (draft,) = drafter.propose([req], [K])
    assert draft.token_ids == [] and draft.probs is None
    drafter.release(req)
    _check_pool(drafter)


def test_a_draft_with_another_tokenizer_is_refused(
    tmp_path, tiny_model_writer, tokenizer, target, target_cfg
):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<not-in-the-target>"])
    path = tiny_model_writer(tmp_path / "other", other)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*tokenizer"):
        make_drafter(_spec_cfg(target_cfg, path), target, None)


def test_bad_draft_settings_are_refused(tmp_path, target, target_cfg, draft_dir):
    with pytest.raises(ValueError, match="tp_size"):
        make_drafter(_spec_cfg(target_cfg, draft_dir, tp_size=2), target, None)
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_drafter(_spec_cfg(target_cfg, tmp_path / "missing"), target, None)


def test_the_draft_pool_holds_the_target_pool_and_one_draft_per_request(drafter, target):
    rows = target.cfg.max_running_requests
    assert drafter.allocator.max_total_tokens == target.max_total_tokens + rows * (K + 1)
    assert drafter.runner.cfg.page_size == 1
    assert drafter.runner.device == target.device and drafter.runner.dtype == target.dtype
    assert drafter.stats()["draft_pool_tokens"] == drafter.allocator.max_total_tokens
