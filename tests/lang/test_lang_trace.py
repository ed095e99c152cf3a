"""Program.trace (SGLang's): the expressions a body appends, recorded without any backend."""

from __future__ import annotations

import pytest

import radixlm.lang as rl
from radixlm.lang.backend_base import BaseBackend
from radixlm.lang.ir import Gen, RoleBegin, RoleEnd, Select, Text, VarScopeBegin, VarScopeEnd
from radixlm.lang.trace import Argument, ProgramTrace, Variable


class NoCalls(BaseBackend):
    """Fails the test if tracing reaches a backend."""

    def __getattribute__(self, name: str):
        if name in ("generate", "select", "cache_prefix", "generate_stream"):
            raise AssertionError(f"trace called the backend's {name}")
        return super().__getattribute__(name)


def _shape(nodes) -> list:
    out = []
    for n in nodes:
        if isinstance(n, Text):
            out.append(n.value)
        elif isinstance(n, (Gen, Select)):
            out.append((type(n).__name__, n.name))
        elif isinstance(n, (RoleBegin, RoleEnd)):
            out.append((type(n).__name__, n.role))
        else:
            out.append((type(n).__name__, n.name))
    return out


def test_trace_records_roles_generations_arguments_and_variables() -> None:
    @rl.function
    def qa(s, question, style="short"):
        s += rl.system("Answer " + style + ".")
        with s.user():
            s += "Q: " + question
        s += rl.assistant(rl.gen("answer", max_tokens=8))
        s += "Sure? " + rl.select("sure", choices=["yes", "no"])
        s += "You said: " + s["answer"]
        with s.var_scope("tail"):
            s += "end"

    rl.set_default_backend(NoCalls())
    try:
        tr = qa.trace()
    finally:
        rl.set_default_backend(None)
    assert isinstance(tr, ProgramTrace) and tr.complete and tr.stopped_by is None
    assert _shape(tr.nodes) == [
        ("RoleBegin", "system"),
        "Answer ",
        ("Argument", "style"),  # not given: a placeholder, its default too (as SGLang)
        ".",
        ("RoleEnd", "system"),
        ("RoleBegin", "user"),
        "Q: ",
        ("Argument", "question"),
        ("RoleEnd", "user"),
        ("RoleBegin", "assistant"),
        ("Gen", "answer"),
        ("RoleEnd", "assistant"),
        "Sure? ",
        ("Select", "sure"),
        "You said: ",
        ("Variable", "answer"),
        ("VarScopeBegin", "tail"),
        "end",
        ("VarScopeEnd", "tail"),
    ]
    assert tr.nodes[10].params.max_new_tokens == 8
    assert tr.nodes[13].choices == ("yes", "no")
    assert isinstance(tr.variables["answer"], Gen)
    assert isinstance(tr.variables["sure"], Select)
    assert isinstance(tr.variables["tail"], VarScopeBegin)
    assert isinstance(tr.last_node, VarScopeEnd)

    given = qa.trace(question="2 + 2?", style="terse", backend=NoCalls())
    assert _shape(given.nodes)[:5] == [
        ("RoleBegin", "system"),
        "Answer terse.",
        ("RoleEnd", "system"),
        ("RoleBegin", "user"),
        "Q: 2 + 2?",
    ]


def test_trace_stops_where_the_body_needs_a_value_only_a_run_gives() -> None:
    @rl.function
    def branchy(s, n):
        s += "start " + rl.gen("x")
        if s["x"] == "yes":  # a comparison of a generated value: unknown while tracing
            s += "never"

    tr = branchy.trace()
    assert not tr.complete and "comparison" in tr.stopped_by
    assert _shape(tr.nodes) == ["start ", ("Gen", "x")]

    @rl.function
    def formatted(s, name):
        s += "Hi "
        s += f"{name}!"  # formatting an argument

    tr = formatted.trace()
    assert not tr.complete and "formatting" in tr.stopped_by and _shape(tr.nodes) == ["Hi "]
    assert formatted.trace(name="Ann").complete
    assert _shape(formatted.trace(name="Ann").nodes) == ["Hi ", "Ann!"]

    @rl.function
    def counted(s, n):
        for _ in range(n):
            s += "x"

    assert "number" in counted.trace().stopped_by
    assert _shape(counted.trace(n=2).nodes) == ["x", "x"]

    @rl.function
    def reads_text(s):
        s += "a"
        s.sync()  # nothing to wait for while tracing
        s += "b"
        return s.text()

    tr = reads_text.trace()
    assert not tr.complete and "needs a run" in tr.stopped_by and _shape(tr.nodes) == ["a", "b"]


def test_trace_of_forks_and_nested_programs() -> None:
    @rl.function
    def step(s, k):
        s += "step " + k + rl.gen("r", max_tokens=4)

    @rl.function
    def tree(s, topic):
        s += "Topic: " + topic + "\n"
        forks = s.fork(2)
        forks += ["A: ", "B: "]
        for f in forks:
            step(f, k="one")
        forks.join()
        s += "done"

    tr = tree.trace(topic="tea")
    assert tr.complete
    assert _shape(tr.nodes) == ["Topic: tea\n", "done"]
    (branches,) = tr.forks
    assert [_shape(b.nodes) for b in branches] == [
        ["A: ", "step one", ("Gen", "r")],
        ["B: ", "step one", ("Gen", "r")],
    ]
    assert [type(g) for g in tr.variables["r"]] == [Gen, Gen]

    @rl.function
    def joined(s):
        forks = s.fork(2)
        forks += rl.gen("a")
        forks.join("concate_join")

    assert _shape(joined.trace().nodes) == [("Gen", "a"), ("Gen", "a")]


def test_trace_checks_its_arguments_and_placeholders_stay_plain_objects() -> None:
    @rl.function
    def f(s, x):
        s += x

    with pytest.raises(ValueError, match="no argument"):
        f.trace(y=1)
    bad_fork = rl.function(lambda s: s.fork(0)).trace()  # the body's own error ends it too
    assert not bad_fork.complete and bad_fork.stopped_by.startswith("ValueError: fork(size)")
    # protocol probes do not end a trace; uses do
    arg = Argument("x")
    assert not hasattr(arg, "__array__") and repr(arg) == "Argument(name='x')"
    assert {arg: 1}[arg] == 1
    assert isinstance("a" + Variable("v") + "b", rl.ir.Concat)
    # a program can still run after being traced
    assert f.trace().complete and _shape(f.trace().nodes) == [("Argument", "x")]
