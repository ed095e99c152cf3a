"""The frontend's semantics over a scripted backend (no model): ordering, fork/join, scopes,
streaming, batches, errors."""

from __future__ import annotations

import random
import threading
import time

import pytest

import radixlm.lang as rl
from radixlm.lang.backend_base import BaseBackend, Prompt
from radixlm.lang.choices import ChoiceLogprobs
from radixlm.lang.ir import GenParams


class ScriptedBackend(BaseBackend):
    """generate() answers "<N>" where N counts the prompt's characters; select() prefers the
    choice whose logprobs are given in ``choice_logprobs``. Every call is recorded."""

    def __init__(self, delay_s: float = 0.0, barrier: threading.Barrier | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.params: list[GenParams] = []
        self.delay_s = delay_s
        self.barrier = barrier
        self.choice_logprobs: dict[str, list[float]] = {}
        self.fail_with: Exception | None = None
        self._lock = threading.Lock()

    def _record(self, kind: str, prompt: Prompt) -> None:
        with self._lock:
            self.calls.append((kind, prompt.text))

    def cache_prefix(self, prompt: Prompt) -> None:
        self._record("prefill", prompt)

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict]:
        self._record("gen", prompt)
        self.params.append(params)
        if self.fail_with is not None:
            raise self.fail_with
        if self.barrier is not None:
            self.barrier.wait(timeout=5)
        if self.delay_s:
            time.sleep(random.random() * self.delay_s)
        return f"<{len(prompt.text)}>", {"prompt_tokens": len(prompt.text)}

    def generate_stream(self, prompt: Prompt, params: GenParams):
        text, meta = self.generate(prompt, params)
        for ch in text:
            yield ch, None
        yield "", meta

    def score_choices(self, prompt: Prompt, choices: list[str], unconditional: bool):
        self._record("score", prompt)
        cond = [self.choice_logprobs.get(c, [-5.0]) for c in choices]
        return ChoiceLogprobs(
            cond, [[-1.0] * (len(c) - 1) for c in cond] if unconditional else None
        )


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


def test_text_and_gen_run_in_order_and_fill_variables(backend):
    @rl.function
    def prog(s, topic):
        s += "About " + topic + ":"
        s += rl.gen("first", max_tokens=3)
        s += " then" + rl.gen("second")

    state = prog.run(topic="cats", backend=backend, temperature=0.5)
    assert state["first"] == "<11>"
    assert state["second"] == f"<{len('About cats:<11> then')}>"
    assert state.text() == "About cats:<11> then<20>"
    assert backend.params[0].max_new_tokens == 3 and backend.params[0].temperature == 0.5
    assert backend.params[1].max_new_tokens == rl.program.DEFAULT_MAX_NEW_TOKENS


def test_missing_variable_names_the_known_ones(backend):
    state = rl.function(lambda s: s.__iadd__("x" + rl.gen("a"))).run(backend=backend)
    with pytest.raises(KeyError, match=r"no variable 'b'.*\['a'\]"):
        state["b"]


def test_fork_prefills_the_prefix_then_runs_branches_concurrently():
    backend = ScriptedBackend(barrier=threading.Barrier(3))  # sequential branches would time out

    @rl.function
    def prog(s):
        s += "Prefix. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}: " + rl.gen("answer")
        forks.join()
        s += "Done."

    state = prog.run(backend=backend)
    assert state._ex.check_integrity()
    assert all(ex.check_integrity() and ex.is_ended for ex in state._ex.children)
    assert backend.calls[0] == ("prefill", "Prefix. ")
    assert sorted(c[1] for c in backend.calls[1:]) == [f"Prefix. Branch {i}: " for i in range(3)]
    assert state["answer"] == ["<18>", "<18>", "<18>"]
    assert state.text() == "Prefix. Done."


def test_join_gathers_per_branch_and_concatenates(backend):
    @rl.function
    def prog(s):
        s += "P|"
        forks = s.fork(2)
        forks += ["a" + rl.gen("x"), "bb"]
        forks[1] += rl.gen("y")
        forks.join("concate_join")

    state = prog.run(backend=backend)
    assert state["x"] == ["<3>", None]
    assert state["y"] == [None, "<4>"]
    assert state.text() == "P|a<3>bb<4>"


def test_var_scope_and_roles(backend):
    @rl.function
    def prog(s):
        with s.user():
            with s.var_scope("question"):
                s += "Why?"
        s += rl.assistant(rl.gen("answer"))

    state = prog.run(backend=backend)
    assert state._ex.check_integrity()
    assert state["question"] == "Why?"
    assert state.messages() == [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": state["answer"]},
    ]
    assert state.text() == rl.ChatTemplate.chatml().render(state.messages())


def test_select_uses_the_method_and_records_scores(backend):
    backend.choice_logprobs = {"yes": [-1.0, -1.0], "no": [-0.5, -3.0], "maybe": [-9.0]}

    @rl.function
    def prog(s):
        s += "Q?"
        s += rl.select("norm", ["yes", "no", "maybe"])
        s += rl.select("greedy", ["yes", "no", "maybe"], choices_method=rl.greedy_token)

    state = prog.run(backend=backend)
    assert state["norm"] == "yes" and state["greedy"] == "no"
    assert state.get_meta_info("norm")["scores"] == [-1.0, -1.75, -9.0]
    assert state.text() == "Q?yesno"


def test_choices_methods_rank_from_logprobs():
    lp = rl.choices.ChoiceLogprobs(
        [[-1.0, -0.1], [-1.0, -0.01], [-0.2, -5.0, -5.0]], [[-0.5], [-3.0], [-0.1, -0.1]]
    )
    names = ["a", "b", "c"]
    assert rl.token_length_normalized(names, lp).decision == "b"
    assert rl.greedy_token(names, lp).decision == "c"
    # (cond - uncond) / len: a: (-1.1+0.5)/2, b: (-1.01+3)/2, c: (-10.2+0.2)/3
    result = rl.unconditional_likelihood_normalized(names, lp)
    assert result.decision == "b"
    assert result.scores == pytest.approx([-0.3, 0.995, -10.0 / 3])


def test_greedy_token_breaks_ties_on_later_tokens():
    lp = rl.choices.ChoiceLogprobs([[-0.5, -2.0], [-0.5, -0.1], [-0.6]])
    assert rl.greedy_token(["x", "y", "z"], lp).index == 1


def test_stream_yields_the_same_text_as_a_normal_run(backend):
    @rl.function
    def prog(s):
        s += rl.user("hello")
        s += rl.assistant(rl.gen("a"))

    whole = prog.run(backend=backend)
    streamed = prog.run(backend=backend, stream=True)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 5
    assert "".join(pieces) == streamed.text() == whole.text()
    assert "".join(prog.run(backend=backend, stream=True).text_iter("a")) == whole["a"]


def test_run_batch_keeps_the_order():
    backend = ScriptedBackend(delay_s=0.02)
    prog = rl.function(lambda s, word: s.__iadd__(word + rl.gen("g")))
    words = ["x" * (i + 1) for i in range(12)]
    states = prog.run_batch([{"word": w} for w in words], backend=backend, num_threads=4)
    assert [s["g"] for s in states] == [f"<{len(w)}>" for w in words]
    assert [s.text() for s in states] == [w + f"<{len(w)}>" for w in words]


def test_bind_and_nested_calls(backend):
    @rl.function
    def inner(s, tag):
        s += f"[{tag}]"

    @rl.function
    def outer(s, a, b):
        inner(s, tag=a)
        s += b

    state = outer.bind(a="A").run(b="B", backend=backend)
    assert state.text() == "[A]B"
    with pytest.raises(ValueError, match="no argument"):
        outer.bind(c=1)


def test_backend_errors_name_the_primitive(backend):
    backend.fail_with = RuntimeError("HTTP 400 from /generate: bad regex")

    @rl.function
    def prog(s):
        s += "x" + rl.gen("answer")

    with pytest.raises(rl.ProgramError, match=r"gen\('answer'\) failed: HTTP 400") as info:
        prog.run(backend=backend)
    assert info.value.primitive == "gen" and info.value.name == "answer"
    states = prog.run_batch([{}, {}], backend=backend)
    assert all(isinstance(s.error(), rl.ProgramError) for s in states)
    with pytest.raises(rl.ProgramError):
        states[0].text()


def test_bad_arguments_are_rejected_where_written():
    with pytest.raises(ValueError, match=r"gen\('n'\): regex"):
        rl.gen("n", regex="(unclosed")
    with pytest.raises(ValueError, match=r"gen\('n'\): dtype"):
        rl.gen("n", dtype=list)
    with pytest.raises(ValueError, match=r"gen\('j'\): json_schema"):
        rl.gen("j", json_schema="{not json")
    with pytest.raises(ValueError, match=r"select\('c'\): choices"):
        rl.select("c", [])
    with pytest.raises(ValueError, match=r"select\('c'\): choices_method"):
        rl.select("c", ["a"], choices_method="best")
    assert rl.gen("n", dtype=int).params.regex == rl.primitives.INT_REGEX
    assert rl.gen("n", json_schema={"type": "object"}).params.json_schema == '{"type": "object"}'


def test_int_gen_converts_and_reports_unparsable_text(backend):
    @rl.function
    def prog(s):
        s += "n=" + rl.gen("n", dtype=int)

    with pytest.raises(rl.ProgramError, match=r"gen\('n'\) failed: .*not a valid int"):
        prog.run(backend=backend)


def test_role_mistakes_and_empty_prompts_are_clear(backend):
    with pytest.raises(rl.ProgramError, match="user_end"):
        rl.function(lambda s: s.__iadd__(rl.user_end())).run(backend=backend)
    with pytest.raises(rl.ProgramError, match="inside the open role"):
        rl.function(lambda s: s.__iadd__(rl.user_begin() + rl.system("x"))).run(backend=backend)
    with pytest.raises(rl.ProgramError, match=r"gen\('a'\) failed: the prompt is empty"):
        rl.function(lambda s: s.__iadd__(rl.gen("a"))).run(backend=backend)
    with pytest.raises(TypeError, match="got int"):
        rl.function(lambda s: s.__iadd__(3)).run(backend=backend)


def test_run_without_a_backend_says_how_to_set_one():
    rl.set_default_backend(None)
    with pytest.raises(ValueError, match="set_default_backend"):
        rl.function(lambda s: None).run()


def test_chat_template_is_measured_from_the_tokenizer_template():
    import jinja2

    source = (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<s>DEFAULT</s>"
        "{% endif %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
    )

    class Tok:
        chat_template = source

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return jinja2.Template(source).render(messages=messages)

    tpl = rl.ChatTemplate.from_tokenizer(Tok())
    assert tpl.prefix("user", is_first=True) == "<s>DEFAULT</s>[user]"
    assert tpl.prefix("user", is_first=False) == "[user]"
    assert tpl.suffix("assistant") == "[/assistant]"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tpl.render(msgs) == Tok().apply_chat_template(msgs, False, False)


def test_openai_reply_maps_to_the_closest_choice():
    from radixlm.lang.backend_openai import closest_choice

    choices = ["Paris", "London", "New York"]
    assert closest_choice("London", choices) == 1
    assert closest_choice("The answer is new york.", choices) == 2
    assert closest_choice("Pariss", choices) == 0


def test_program_arguments_win_over_sampling_option_names(backend):
    @rl.function
    def prog(s, stop):
        s += f"stop={stop} " + rl.gen("x")

    state = prog.run(stop="here", backend=backend, max_new_tokens=7)
    assert state.text().startswith("stop=here ")
    assert backend.params[0].stop is None and backend.params[0].max_new_tokens == 7


def test_http_select_finds_choice_tokens_that_merged_with_the_prefix():
    """The endpoint re-scores the prefix's last tokens: where a choice's row leaves the
    prefix's own ids is where the choice begins, even inside the prefix's token count."""
    from radixlm.lang.backend_http import RuntimeEndpoint

    sent = []

    def fake_generate(body):
        sent.append(body)
        if body["sampling_params"] == {"max_new_tokens": 0} and "return_logprob" not in body:
            return {"meta_info": {"prompt_tokens": 10, "cached_tokens": 0}}
        rows = [
            [[-0.1, 6, None], [-0.2, 7, None], [-0.3, 8, None], [-0.4, 9, None]],  # prefix
            [
                [-0.1, 6, None],
                [-0.2, 7, None],
                [-0.3, 8, None],
                [-2.0, 90, None],
                [-1.0, 91, None],
            ],  # its last token merged with the choice's first
            [[-0.1, 6, None], [-0.2, 7, None], [-0.3, 8, None], [-0.4, 9, None], [-0.5, 92, None]],
        ]  # a clean boundary
        return [{"meta_info": {"input_token_logprobs": r, "cached_tokens": 5}} for r in rows]

    endpoint = object.__new__(RuntimeEndpoint)
    endpoint._generate = fake_generate
    lp = endpoint.score_choices(Prompt("prefix text"), ["a", "b"], unconditional=False)
    assert lp.conditional == [[-2.0, -1.0], [-0.5]]
    assert lp.cached_tokens == [5, 5]
    assert sent[1]["logprob_start_len"] == 10 - rl.backend_base.BOUNDARY_TOKENS
    assert sent[1]["text"] == ["prefix text", "prefix texta", "prefix textb"]


# ---------------------------------------------------------------- SGLang's other entry points
def test_sglang_run_batch_forms_copy_and_async_text_iter(backend) -> None:
    """run_batch with tuples and generator_style, s.copy(), text_async_iter, n / use_thread /
    num_api_spec_tokens as SGLang programs pass them."""
    import asyncio

    @rl.function
    def greet(s, name, punct="!"):
        s += "Hi " + name + punct
        s += rl.gen("x", max_tokens=3)

    states = greet.run_batch([("Ann",), ("Bob", "?")], backend=backend, n=1)
    assert [st.text() for st in states] == ["Hi Ann!<7>", "Hi Bob?<7>"]
    gen = greet.run_batch([{"name": "Cy"}, ("Di",)], backend=backend, generator_style=True)
    assert not isinstance(gen, list)
    assert [st.text() for st in gen] == ["Hi Cy!<6>", "Hi Di!<6>"]
    with pytest.raises(ValueError, match="n must be 1"):
        greet.run(name="Ann", backend=backend, n=2)
    assert greet.run(name="Ann", backend=backend, use_thread=False).text().startswith("Hi Ann!")
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        rl.function(num_api_spec_tokens=64)

    @rl.function
    def branch(s):
        s += "Root."
        with s.copy() as c:
            c += rl.gen("y", max_tokens=2)

    st = branch.run(backend=backend)
    assert isinstance(st["y"], list) and len(st["y"]) == 1

    async def collect():
        state = greet.run(name="Eve", backend=backend, stream=True)
        return [piece async for piece in state.text_async_iter()], state

    pieces, state = asyncio.run(collect())
    assert "".join(pieces) == state.text()


class ThinkingBackend(ScriptedBackend):
    """Answers a reasoning block, then the scripted answer."""

    def __init__(self, opened_by_template: bool = False) -> None:
        super().__init__()
        self.opened_by_template = opened_by_template

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict]:
        answer, meta = super().generate(prompt, params)
        block = "mull it over\n</think>\n\n"
        return (block if self.opened_by_template else "<think>\n" + block) + answer, meta


def test_separate_reasoning_moves_the_block_out_of_variables_text_and_history():
    backend = ThinkingBackend()

    @rl.function
    def prog(s):
        s += rl.user("Q1?")
        s += rl.assistant("A: " + rl.separate_reasoning(rl.gen("a"), model_type="qwen3"))
        s += rl.user("Q2?")
        s += rl.assistant(rl.gen("b"))

    state = prog.run(backend=backend)
    assert state["a"].startswith("<") and "think" not in state["a"]
    assert state["a_reasoning_content"] == "mull it over"
    assert state.text().count("mull") == 1 and "A: " + state["a"] in state.text()  # b's only
    assert state.messages()[1] == {"role": "assistant", "content": "A: " + state["a"]}
    second_prompt = backend.calls[1][1]
    assert "mull" not in second_prompt and "A: " + state["a"] in second_prompt
    assert "mull" in state["b"]  # not separated
    assert state._ex.check_integrity()


def test_separate_reasoning_after_the_role_and_for_deepseek_r1():
    backend = ThinkingBackend(opened_by_template=True)

    @rl.function
    def prog(s):
        s += rl.user("Q?")
        s += rl.separate_reasoning(
            rl.assistant(rl.gen("a")) + rl.assistant(rl.gen("b")), model_type="deepseek-r1"
        )

    state = prog.run(backend=backend)
    assert state["a_reasoning_content"] == state["b_reasoning_content"] == "mull it over"
    assert "mull" not in state.text() and "mull" not in str(state.messages())
    assert state._ex.check_integrity()


def test_separate_reasoning_streamed_splits_the_variables_only():
    backend = ThinkingBackend()
    prog = rl.function(
        lambda s: s.__iadd__(
            rl.user("Q?") + rl.assistant(rl.separate_reasoning(rl.gen("a"), model_type="qwen3"))
        )
    )
    state = prog.run(backend=backend, stream=True)
    pieces = "".join(state.text_iter("a"))
    assert "mull" in pieces and "mull" in state.text()  # what was streamed stays streamed
    assert state["a_reasoning_content"] == "mull it over" and "mull" not in state["a"]


def test_separate_reasoning_refusals():
    with pytest.raises(ValueError, match="model_type must be one of"):
        rl.separate_reasoning(rl.gen("a"), model_type="glm45")
    with pytest.raises(ValueError, match="model_type must be one of"):
        rl.separate_reasoning(rl.gen("a"))
    with pytest.raises(ValueError, match="named gen or select"):
        rl.separate_reasoning(rl.gen(), model_type="qwen3")


FEW_SHOT = "".join(f"Q: What is {i} + {i}?\nA: {2 * i}\n" for i in range(6))


def test_cache_prefills_the_constant_opening_only(backend):
    @rl.function
    def few_shot(s, question, style="short"):
        s += FEW_SHOT
        s += "Style: "
        s += style  # bound below: constant
        s += "\nQ: " + question + "\n"  # depends on the argument: the trace ends here
        s += "A:" + rl.gen("answer", max_tokens=8)

    @rl.function
    def chat(s, question):
        s += rl.system(FEW_SHOT)  # a role: nothing constant before it
        s += rl.user(question)

    @rl.function
    def short(s, x):
        s += "Q: " + x

    @rl.function
    def arithmetic(s, n):
        s += FEW_SHOT
        for _ in range(n):  # a placeholder used as a number ends the trace too
            s += "more"

    few_shot.bind(style="terse").cache(backend=backend)
    few_shot.cache(backend=backend)
    chat.cache(backend=backend)
    short.cache(backend=backend)
    arithmetic.cache(backend=backend)
    assert backend.calls == [
        ("prefill", FEW_SHOT + "Style: terse"),
        ("prefill", FEW_SHOT + "Style: "),
        ("prefill", FEW_SHOT),
    ]
    # a run afterwards is unchanged, and its prompt starts with the cached text
    state = few_shot.run(question="1 + 9", backend=backend)
    assert state["answer"] and backend.calls[-1][1].startswith(FEW_SHOT + "Style: short")


def test_cache_of_a_program_calling_another(backend):
    @rl.function
    def intro(s):
        s += FEW_SHOT

    @rl.function
    def outer(s, q):
        intro(s)
        s += "Q: " + q

    outer.cache(backend=backend)
    assert backend.calls == [("prefill", FEW_SHOT)]
