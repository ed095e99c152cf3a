"""SGLang's own frontend language (``sglang.lang`` over ``RuntimeEndpoint``) against a radixlm
server: gen with stop, stop_regex and regex, select, fork and join, chat roles, streaming.
It needs the sglang package and the few modules its frontend imports, installed without
their dependencies (see SGLANG_INSTALL); the module is skipped without them."""

from __future__ import annotations

import re

import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

SGLANG_INSTALL = (
    "pip install --no-deps sglang==0.5.23 pybase64 pillow msgspec ipython traitlets aiohttp "
    "multidict yarl propcache aiohappyeyeballs aiosignal frozenlist"
)
try:
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
except ImportError as e:  # the frontend or one of its imports is missing
    pytest.skip(
        f"SGLang's frontend is not installed ({e}): {SGLANG_INSTALL}", allow_module_level=True
    )


@pytest.fixture(scope="module")
def backend(default_server) -> RuntimeEndpoint:
    server: ServerProcess = default_server
    endpoint = RuntimeEndpoint(server.url, chat_template_name="chatml")  # SmolLM2's template
    sgl.set_default_backend(endpoint)
    return endpoint


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=16, stop="\n", temperature=0)


@sgl.function
def year(s):
    s += "The year is " + sgl.gen("year", regex=r"[0-9]{4}", temperature=0)


@sgl.function
def capital(s):
    s += "The capital of France is " + sgl.select("city", choices=["Paris", "London", "Rome"])


@sgl.function
def two_colors(s):
    s += "List two colors:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("color", max_tokens=5, stop="\n", temperature=0)
    forks.join()
    s += "1." + forks[0]["color"] + "\n2." + forks[1]["color"]


@sgl.function
def chat(s):
    s += sgl.system("You are terse.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))


@sgl.function
def count(s, pattern):  # not "stop_regex": run() takes that name as a sampling default
    s += "Count: 1, 2, 3, 4, 5" + sgl.gen(
        "rest", max_tokens=30, stop_regex=pattern, temperature=0, ignore_eos=True
    )


def test_gen_with_stop(backend) -> None:
    state = qa.run(question="What is the capital of France?")
    assert "Paris" in state["answer"] and "\n" not in state["answer"]
    assert state.get_meta_info("answer")["finish_reason"] == {"type": "stop", "matched": "\n"}


def test_gen_with_regex(backend) -> None:
    assert re.fullmatch(r"[0-9]{4}", year.run()["year"])


def test_select(backend) -> None:
    state = capital.run()
    assert state["city"] == "Paris" and state.text().endswith("is Paris")


def test_fork_and_join(backend) -> None:
    state = two_colors.run()
    colors = [c.strip() for c in re.findall(r"[12]\.(.*)", state.text())]
    assert len(colors) == 2 and all(colors) and all("\n" not in c for c in colors)


def test_roles_use_the_chat_template(backend) -> None:
    state = chat.run()
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in state.text()
    assert "<|im_start|>assistant\n" in state.text() and "Paris" in state["answer"]


def test_stop_regex_matches_like_re(backend) -> None:
    """The text before the first match of the pattern in the unstopped output, as ``re``
    finds it, is what the stopped gen returns."""
    full = count.run(pattern=None)["rest"]
    m = re.search(r"\b8\b", full)
    assert m is not None, full
    state = count.run(pattern=r"\b8\b")
    assert state["rest"] == full[: m.start()]
    # SGLang reports the pattern as what matched
    assert state.get_meta_info("rest")["finish_reason"] == {"type": "stop", "matched": r"\b8\b"}


def test_streaming(backend) -> None:
    state = qa.run(question="Name a fruit.", stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) >= 1 and "".join(chunks) == state.text()


@sgl.function
def chat_past_eos(s):
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, temperature=0, ignore_eos=True))


def test_chatml_stop_ends_the_turn_even_with_ignore_eos(backend) -> None:
    """The chatml template's stop "<|im_end|>" matches the special token (SGLang decodes the
    tail with special tokens), so the answer ends with its turn."""
    answer = chat_past_eos.run()["answer"]
    assert "Paris" in answer and "system" not in answer and "<|im_end|>" not in answer


def test_profile_routes(backend, tmp_path) -> None:
    """RuntimeEndpoint's start_profile / stop_profile (GET, no body), and a POST with SGLang's
    ProfileReq fields: the trace is a gzipped Chrome trace of the steps."""
    import gzip
    import json

    body = {"output_dir": str(tmp_path), "num_steps": 50, "profile_id": "t", "record_shapes": True}
    started = plain_http.post(backend.base_url + "/start_profile", json=body, timeout=30).json()
    assert started["path"] == str(tmp_path / "t-TP-0.trace.json.gz")
    assert qa.run(question="Name a fruit.")["answer"]  # reading it waits for the run
    backend.stop_profile()
    trace = json.loads(gzip.decompress((tmp_path / "t-TP-0.trace.json.gz").read_bytes()))
    names = {str(e.get("name")) for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    backend.start_profile()  # the default folder
    assert qa.run(question="Name a color.")["answer"]  # reading it waits for the run
    stopped = plain_http.post(backend.base_url + "/stop_profile", timeout=60).json()
    path = stopped["path"]
    assert path.endswith("-TP-0.trace.json.gz")
    import os

    os.remove(path)
    r = plain_http.post(backend.base_url + "/stop_profile", timeout=30)  # none runs now
    assert r.status_code == 400 and "no profile" in r.json()["error"]["message"]
    bad = plain_http.post(backend.base_url + "/start_profile", json={"activities": ["GPU"]})
    assert bad.status_code == 400 and "GPU" in bad.json()["error"]["message"]
    bad = plain_http.post(backend.base_url + "/start_profile", json={"merge_profile": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "merge_profile"
