"""Programs on the default model (SmolLM2-135M-Instruct), run through both backends: the
in-process Engine (LocalBackend) and a server over HTTP (RuntimeEndpoint). Every expected value
is recomputed here from raw generate calls (logprobs, greedy texts), not taken from the frontend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import plain_http
import pytest

import radixlm.lang as rl
from radixlm.lang.backend_base import BOUNDARY_TOKENS
from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow  # every backend runs the default model (smol_engine)

GREEDY = {"temperature": 0}
FEW_SHOT = (
    "Q: What is the capital of Italy?\nA: Rome\n"
    "Q: What is the capital of Spain?\nA: Madrid\n"
    "Q: What is the capital of France?\nA:"
)
CHOICES = [" Paris", " Berlin", " Lyon", " The Eiffel Tower"]

RawGenerate = Callable[..., dict]


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module", params=["local", pytest.param("http", marks=pytest.mark.slow)])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def backend(kind: str, request: pytest.FixtureRequest, smol_engine) -> Iterator[rl.BaseBackend]:
    if kind == "local":
        yield rl.LocalBackend(smol_engine)
    else:
        endpoint = rl.RuntimeEndpoint(request.getfixturevalue("server").url)
        yield endpoint
        endpoint.shutdown()


@pytest.fixture(scope="module")
def raw(kind: str, request: pytest.FixtureRequest, smol_engine) -> RawGenerate:
    """A plain generate call on the same runtime as ``backend``, bypassing the frontend."""
    if kind == "local":
        return smol_engine.generate
    url = request.getfixturevalue("server").url

    def post(prompt=None, sampling_params=None, input_ids=None, **kw) -> dict:
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params, **kw}
        r = plain_http.post(
            url + "/generate", json={k: v for k, v in body.items() if v is not None}, timeout=300
        )
        assert r.status_code == 200, r.text
        return r.json()

    return post


@pytest.fixture(scope="module")
def tok(smol_engine):
    return smol_engine.tokenizer


def token_logprobs(raw: RawGenerate, ids: list[int], start: int) -> list[float]:
    out = raw(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    return [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]


def expected_scores(raw: RawGenerate, tok, method: str) -> list[float]:
    prefix_ids = tok.encode(FEW_SHOT)
    scores = []
    for choice in CHOICES:
        ids = tok.encode(FEW_SHOT + choice)
        assert ids[: len(prefix_ids)] == prefix_ids
        cond = token_logprobs(raw, ids, len(prefix_ids))
        assert len(cond) == len(ids) - len(prefix_ids)
        if method == "token_length_normalized":
            scores.append(sum(cond) / len(cond))
        elif method == "greedy_token":
            scores.append(cond[0])
        else:
            uncond = token_logprobs(raw, tok.encode(choice), 0)
            scores.append((sum(cond) - sum(uncond)) / len(cond))
    return scores


@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy_token", "unconditional_likelihood_normalized"]
)
def test_select_picks_the_highest_normalized_logprob(backend, raw, tok, method):
    @rl.function
    def quiz(s):
        s += FEW_SHOT + rl.select("answer", CHOICES, choices_method=method)

    backend.flush_cache()
    state = quiz.run(backend=backend)
    meta = state.get_meta_info("answer")
    num_prefix = len(tok.encode(FEW_SHOT))  # the prefix was prefilled first: every choice reuses it
    assert all(c >= num_prefix - 1 - BOUNDARY_TOKENS for c in meta["cached_tokens"]), meta
    expected = expected_scores(raw, tok, method)
    best = max(range(len(CHOICES)), key=lambda i: expected[i])
    assert state["answer"] == CHOICES[best]
    assert meta["scores"] == pytest.approx(expected, abs=2e-3)
    assert state.text() == FEW_SHOT + CHOICES[best]


def test_fork_join_collects_every_branch_and_reuses_the_prefix(backend, raw, tok):
    prefix = "Here are three short facts about the sea.\n"

    @rl.function
    def facts(s):
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + rl.gen("fact", max_tokens=6, stop="\n")
        forks.join()
        s["metas"] = [f.get_meta_info("fact") for f in forks]

    backend.flush_cache()
    state = facts.run(backend=backend, **GREEDY)
    assert len(state["fact"]) == 3
    for i, fact in enumerate(state["fact"]):
        alone = raw(
            prompt=prefix + f"Fact {i + 1}:",
            sampling_params={"max_new_tokens": 6, "stop": "\n", **GREEDY},
        )
        assert fact == alone["text"]
    num_prefix = len(tok.encode(prefix))
    assert all(m["cached_tokens"] >= num_prefix - 1 for m in state["metas"]), state["metas"]
    assert state.text() == prefix  # gather_variable leaves the parent's text alone


def test_regex_and_int_constrained_gens_match(backend):
    @rl.function
    def form(s):
        s += rl.user("Invent a product code and a price in dollars for a new gadget.")
        s += rl.assistant_begin()
        s += "Code: " + rl.gen("code", max_tokens=8, regex=r"[A-Z]{3}-[0-9]{3}")
        s += "\nPrice: " + rl.gen("price", max_tokens=5, dtype=int)
        s += rl.assistant_end()

    state = form.run(backend=backend, **GREEDY)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", state["code"]), state["code"]
    assert isinstance(state["price"], int)
    assert f"Price: {state['price']}<|im_end|>" in state.text()


def test_gen_logprob_options_and_min_tokens_reach_the_runtime(backend, raw):
    """SGLang's gen(return_logprob=..., top_logprobs_num=..., min_tokens=...): the meta info
    holds what a raw call with the same options returns (streamed runs too)."""

    @rl.function
    def qa(s):
        s += FEW_SHOT
        s += rl.gen("a", max_tokens=6, stop="\n", return_logprob=True, top_logprobs_num=2)
        s += "\n" + rl.gen("b", max_tokens=6, min_tokens=5, stop=".")

    for stream in (False, True):
        state = qa.run(backend=backend, stream=stream, **GREEDY)
        state.sync()
        want = raw(
            prompt=FEW_SHOT,
            sampling_params={"max_new_tokens": 6, "stop": "\n", **GREEDY},
            return_logprob=True,
            top_logprobs_num=2,
        )["meta_info"]
        meta = state.get_meta_info("a")
        assert [e[1] for e in meta["output_token_logprobs"]] == [
            e[1] for e in want["output_token_logprobs"]
        ]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        assert (
            "output_token_logprobs" not in state.get_meta_info("b")
            or not state.get_meta_info("b")["output_token_logprobs"]
        )
        assert state.get_meta_info("b")["completion_tokens"] >= 5
    with pytest.raises(ValueError, match="n must be 1"):
        rl.gen("x", n=2)
    with pytest.raises(ValueError, match="temperature must be 0"):
        rl.select("x", ["a", "b"], temperature=0.5)
    with pytest.raises(ValueError, match="text only"):
        rl.image("cat.png")


def test_streaming_yields_the_text_of_a_normal_run(backend):
    @rl.function
    def chat(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=12))

    whole = chat.run(question="Describe the moon.", backend=backend, **GREEDY)
    streamed = chat.run(question="Describe the moon.", backend=backend, stream=True, **GREEDY)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 6  # role texts, the question and the answer token by token
    assert "".join(pieces) == streamed.text() == whole.text()
    assert streamed["answer"] == whole["answer"]


def test_run_batch_returns_states_in_order(backend, raw):
    @rl.function
    def capital(s, country):
        s += f"The capital of {country} is" + rl.gen("city", max_tokens=3)

    countries = ["France", "Japan", "Italy", "Germany", "Egypt"]
    states = capital.run_batch(
        [{"country": c} for c in countries],
        backend=backend,
        num_threads=3,
        progress_bar=True,
        **GREEDY,
    )
    expected = [
        raw(prompt=f"The capital of {c} is", sampling_params={"max_new_tokens": 3, **GREEDY})[
            "text"
        ]
        for c in countries
    ]
    assert [s["city"] for s in states] == expected
    assert [s.text() for s in states] == [
        f"The capital of {c} is{e}" for c, e in zip(countries, expected, strict=True)
    ]


def test_roles_render_through_the_chat_template(backend, raw, tok):
    @rl.function
    def chat(s):
        s += rl.system("You answer in one word.")
        s += rl.user("Name a color.")
        s += rl.assistant(rl.gen("first", max_tokens=6))
        s += rl.user("Another one.")
        with s.assistant():
            s += rl.gen("second", max_tokens=6)

    state = chat.run(backend=backend, **GREEDY)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == tok.apply_chat_template(msgs, tokenize=False)
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert (
        msgs[2]["content"]
        == raw(prompt=prompt, sampling_params={"max_new_tokens": 6, **GREEDY})["text"]
    )

    no_system = rl.function(lambda s: s.__iadd__(rl.user("Hi") + rl.assistant("Hello")))
    state = no_system.run(backend=backend)
    assert state.text() == tok.apply_chat_template(state.messages(), tokenize=False)
    assert "You are a helpful AI assistant" in state.text()  # the template's default system


def test_server_side_errors_name_the_primitive(backend):
    @rl.function
    def bad(s):
        s += "Hello" + rl.gen("greeting", max_tokens=2, top_k=0)

    with pytest.raises(rl.ProgramError, match=r"gen\('greeting'\) failed: .*top_k") as info:
        bad.run(backend=backend)
    assert info.value.primitive == "gen"


@pytest.mark.slow
def test_openai_backend_gen_and_select_by_prompting(server, tok, smol_engine):
    backend = rl.OpenAI("default", base_url=server.url + "/v1", supports_regex=True)

    @rl.function
    def chat(s):
        s += rl.user("What is the capital of France?")
        s += rl.assistant(rl.gen("answer", max_tokens=12))
        s += rl.user("Is that city in Europe or in Asia?")
        s += rl.assistant(rl.select("where", ["Europe", "Asia"]))

    state = chat.run(backend=backend, **GREEDY)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = smol_engine.generate(prompt, {"max_new_tokens": 12, **GREEDY})["text"]
    assert state["answer"] == expected
    assert state["where"] in ("Europe", "Asia")
    assert state.messages()[-1] == {"role": "assistant", "content": state["where"]}
    backend.shutdown()


def test_server_and_model_info_through_the_backend(backend):
    assert rl.get_server_info(backend)["max_total_tokens"] > 0
    info = backend.get_model_info()
    assert info["model_path"] and info["context_length"] > 0
