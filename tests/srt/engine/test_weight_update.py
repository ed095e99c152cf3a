"""update_weights_from_disk (SGLang's): another checkpoint of the same shape loaded in place
gives exactly the outputs of an engine started on it; a checkpoint of another shape, or one that
fails part-way, leaves the previous weights; the prefix cache is emptied. Tiny random Llama."""

from __future__ import annotations

import re
import shutil
import time

import plain_http
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlm.srt import Engine

PROMPTS = ["The weather today is", "Count: one, two,", "A short story about a cat"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
POOL = 2048


def _outputs(engine: Engine, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [engine.generate(p, GREEDY)["output_ids"] for p in prompts]


def _rewrite(folder, change) -> None:
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    save_file(change(tensors), str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def other_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model's folder with every weight perturbed (same shapes, other outputs)."""
    folder = tmp_path_factory.mktemp("other") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    gen = torch.Generator().manual_seed(1)
    _rewrite(
        folder,
        lambda ts: {
            k: v + 0.05 * torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in ts.items()
        },
    )
    return folder


def test_weights_swap_in_place_and_back(tiny_llama_dir, other_dir, tmp_path, tiny_model_writer):
    with Engine(str(other_dir), max_total_tokens=POOL, log_level="warning") as fresh:
        want_other = _outputs(fresh)
    with Engine(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning") as engine:
        want_first = _outputs(engine)
        assert want_first != want_other
        ok, message, paused = engine.update_weights_from_disk(str(other_dir), weight_version="v2")
        assert ok and paused == 0 and str(other_dir) in message
        assert engine.get_server_info()["weight_version"] == "v2"
        again = engine.generate(PROMPTS[0], GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0  # the old weights' KV is gone
        assert [again["output_ids"], *_outputs(engine)[1:]] == want_other

        # another shape: refused before anything is written
        small = tiny_model_writer(tmp_path / "small", engine.tokenizer, hidden_size=32)
        ok, message, _ = engine.update_weights_from_disk(str(small))
        assert not ok and "hidden_size 32" in message
        # a checkpoint missing a tensor fails part-way: the previous weights come back
        broken = tmp_path / "broken"
        shutil.copytree(other_dir, broken)
        _rewrite(broken, lambda ts: {k: v for k, v in ts.items() if "layers.1.mlp" not in k})
        ok, message, _ = engine.update_weights_from_disk(str(broken))
        assert not ok and "previous weights are back" in message
        ok, message, _ = engine.update_weights_from_disk(str(tmp_path / "nowhere"))
        assert not ok and "cannot read" in message
        assert _outputs(engine) == want_other

        ok, _, _ = engine.update_weights_from_disk(str(tiny_llama_dir))
        assert ok and _outputs(engine) == want_first
        assert engine.scheduler.check_idle()
        u = engine.scheduler.kv.usage()
        assert u["available"] + u["evictable"] + u["protected"] == POOL, u


@pytest.mark.slow
def test_an_update_waits_for_the_requests_in_flight(tiny_llama_dir, other_dir):
    """A request running when the update is asked for finishes on the old weights."""
    import threading

    long = {**GREEDY, "max_new_tokens": 300}
    with Engine(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning") as engine:
        want = engine.generate(PROMPTS[1], long)["output_ids"]
        box: dict = {}
        caller = threading.Thread(target=lambda: box.update(out=engine.generate(PROMPTS[1], long)))
        caller.start()
        while not engine.scheduler.running and caller.is_alive():
            caller.join(0.001)
        ok, _, _ = engine.update_weights_from_disk(str(other_dir))
        caller.join(60)
        assert ok and box["out"]["output_ids"] == want
        assert engine.scheduler.check_idle()


@pytest.fixture(scope="module")
def weights_server(tiny_llama_dir, start_server):
    """One server on the tiny model for the module's HTTP tests (one start instead of one per
    test): each test leaves it serving and unpaused, on either checkpoint, and asserts only the
    outputs of the weights it loads itself."""
    return start_server("--model-path", tiny_llama_dir, "--max-total-tokens", POOL)


@pytest.fixture(scope="module")
def other_outputs(other_dir) -> list[list[int]]:
    """Greedy outputs of an engine started on the other checkpoint (the HTTP tests' reference)."""
    with Engine(str(other_dir), max_total_tokens=POOL, log_level="warning") as fresh:
        return _outputs(fresh)


@pytest.mark.slow  # starts a server
def test_http_route_pauses_new_requests_and_answers_in_sglangs_shape(
    other_dir, weights_server, other_outputs
):
    import threading

    url = weights_server.url

    def generate(prompt: str, max_new_tokens: int = 8) -> list[int]:
        body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
        r = plain_http.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    want_other = other_outputs
    before = [generate(p) for p in PROMPTS]
    # a long request in flight: the update waits for it; a request sent meanwhile waits too
    box: dict = {}
    long = threading.Thread(target=lambda: box.update(long=generate(PROMPTS[1], 1500)))
    long.start()
    while plain_http.get(url + "/get_server_info").json()["kv_pool"]["num_running"] == 0:
        time.sleep(0.01)
    update: dict = {}
    updater = threading.Thread(
        target=lambda: update.update(
            r=plain_http.post(
                url + "/update_weights_from_disk",
                json={"model_path": str(other_dir), "weight_version": "step-7"},
                timeout=120,
            )
        )
    )
    updater.start()
    while not plain_http.get(url + "/get_server_info").json()["weight_update_pending"]:
        time.sleep(0.01)
    late = generate(PROMPTS[0])  # paused until the new weights are in
    updater.join(120)
    long.join(120)
    r = update["r"]
    assert r.status_code == 200, r.text
    assert r.json()["success"] and r.json()["num_paused_requests"] >= 1
    assert late == want_other[0] and [generate(p) for p in PROMPTS] == want_other
    assert box["long"][:8] == before[1]  # it ran on the old weights to its end
    info = plain_http.get(url + "/get_server_info").json()
    assert info["weight_version"] == "step-7"
    bad = plain_http.post(
        url + "/update_weights_from_disk", json={"model_path": "/nowhere"}, timeout=60
    )
    assert bad.status_code == 400 and not bad.json()["success"]
    assert bad.json()["error"]["param"] == "model_path"
    refused = plain_http.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(other_dir), "is_async": True},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "is_async"
    assert [generate(p) for p in PROMPTS] == want_other  # still the new weights
    relabel = plain_http.post(url + "/update_weight_version", json={"new_version": "step-8"})
    assert relabel.status_code == 200 and relabel.json()["new_version"] == "step-8"
    assert plain_http.get(url + "/get_server_info").json()["weight_version"] == "step-8"
    assert plain_http.get(url + "/ping").status_code == 200


def test_a_disk_kv_tier_never_serves_the_old_weights_pages(
    tiny_llama_dir, other_dir, tmp_path, tiers_always_load
):
    """Pages written with one checkpoint live in that checkpoint's folder: after an update the
    disk tier reads and writes another folder, and going back finds the first one's pages."""
    options = dict(
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through",
        hicache_storage_dir=str(tmp_path / "kv"),
        max_total_tokens=POOL,
        log_level="warning",
    )
    long = [p + " " + " ".join(f"word{i}" for i in range(40)) for p in PROMPTS]  # whole pages
    with Engine(str(other_dir), max_total_tokens=POOL, log_level="warning") as fresh:
        want_other = _outputs(fresh, long)
    with Engine(str(tiny_llama_dir), **options) as engine:
        want_first = _outputs(engine, long)
        assert engine.scheduler.cache.storage.flush(10)
        ok, _, _ = engine.update_weights_from_disk(str(other_dir), flush_cache=False)
        assert ok  # (a disk tier empties the cache anyway)
        assert _outputs(engine, long) == want_other
        assert engine.get_server_info()["hicache"]["disk_hit_tokens"] == 0
        ok, _, _ = engine.update_weights_from_disk(str(tiny_llama_dir))
        assert ok and _outputs(engine, long) == want_first
        assert engine.get_server_info()["hicache"]["disk_hit_tokens"] > 0  # the first pages
    folders = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
    assert len(folders) == 2  # one per checkpoint


@pytest.mark.slow  # starts a server
def test_pause_update_continue_as_rl_loops_do(
    tiny_llama_dir, other_dir, weights_server, other_outputs
):
    """/pause_generation (abort mode) aborts what runs and holds new requests; a weight update
    runs meanwhile; /continue_generation lets the held request through, on the new weights.
    In retract mode the running request waits without KV through an update and then ends."""
    import threading

    url = weights_server.url
    want_other = other_outputs[0]
    body = {"text": PROMPTS[0], "sampling_params": GREEDY}
    running: dict = {}

    def start_running(max_new_tokens: int) -> threading.Thread:
        """A /generate of that length in a thread, returned once the scheduler runs it."""
        long = {"text": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
        runner = threading.Thread(
            target=lambda: running.update(
                r=plain_http.post(url + "/generate", json=long, timeout=120)
            )
        )
        runner.start()
        while plain_http.get(url + "/get_server_info").json()["kv_pool"]["num_running"] == 0:
            time.sleep(0.01)
        return runner

    runner = start_running(1500)
    assert plain_http.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 200
    runner.join(60)
    assert running["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    held: dict = {}
    waiter = threading.Thread(
        target=lambda: held.update(r=plain_http.post(url + "/generate", json=body, timeout=120))
    )
    waiter.start()
    while plain_http.get(url + "/get_server_info").json()["num_paused_requests"] == 0:
        time.sleep(0.01)
    update = {"model_path": str(other_dir)}
    r = plain_http.post(url + "/update_weights_from_disk", json=update, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert waiter.is_alive()  # still held: the pause outlasts the update
    refused = plain_http.post(url + "/pause_generation", json={"mode": "freeze"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
    assert plain_http.post(url + "/continue_generation", json={}).status_code == 200
    waiter.join(60)
    assert held["r"].json()["output_ids"] == want_other

    # retract mode: the running request waits without its KV through an update, then ends
    runner = start_running(400)
    assert plain_http.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
    info = plain_http.get(url + "/get_server_info").json()["kv_pool"]
    assert info["num_running"] == 0 and info["num_waiting"] == 1, info
    assert info["paused"] == "retract"
    assert info["available"] + info["evictable"] == info["max_total_tokens"], info
    update = {"model_path": str(tiny_llama_dir)}
    r = plain_http.post(url + "/update_weights_from_disk", json=update, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert runner.is_alive()
    assert plain_http.post(url + "/continue_generation").status_code == 200
    runner.join(60)
    meta = running["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400


def test_get_weights_by_name_reads_the_running_weights(tiny_llama_dir, other_dir):
    """SGLang's get_weights_by_name: checkpoint names (merged projections' rows included, a tied
    lm_head through the embedding), the first truncate_size rows, the new values after an
    update; bad names and sizes are ValueErrors naming them."""
    (path,) = tiny_llama_dir.glob("*.safetensors")
    first = load_file(str(path))
    (path,) = other_dir.glob("*.safetensors")
    other = load_file(str(path))
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    with Engine(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning") as engine:
        dtype = next(engine.scheduler.runner.model.parameters()).dtype

        def want(tensors, name, rows):
            return tensors[name][:rows].to(dtype).float()

        for name in names:
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=3))
            assert torch.equal(got, want(first, name, 3)), name
        assert len(engine.get_weights_by_name("model.norm.weight")) == min(
            100, first["model.norm.weight"].numel()
        )
        head = "lm_head.weight" if "lm_head.weight" in first else "model.embed_tokens.weight"
        got = torch.tensor(engine.get_weights_by_name("lm_head.weight", 2))
        assert torch.equal(got, want(first, head, 2))
        ok, message, _ = engine.update_weights_from_disk(str(other_dir))
        assert ok, message
        name = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 2)), want(other, name, 2))
        with pytest.raises(ValueError, match="no weight named 'model.layers.9.mlp.up_proj"):
            engine.get_weights_by_name("model.layers.9.mlp.up_proj.weight")
        with pytest.raises(ValueError, match="no weight named"):
            engine.get_weights_by_name("model.layers.0.self_attn.rotary_emb.inv_freq")
        with pytest.raises(ValueError, match="truncate_size"):
            engine.get_weights_by_name(name, 0)
        assert engine.scheduler.check_idle()


def test_update_weights_from_tensor_in_buckets(tiny_llama_dir, other_dir):
    """SGLang's in-process update_weights_from_tensor: the other checkpoint's tensors sent in
    two buckets (the cache kept after the first, as RL loops do) give exactly the outputs of an
    engine started on it; a bucket with an unknown name or another shape changes nothing."""
    (path,) = other_dir.glob("*.safetensors")
    other = load_file(str(path))
    with Engine(str(other_dir), max_total_tokens=POOL, log_level="warning") as fresh:
        want_other = _outputs(fresh)
    with Engine(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning") as engine:
        want_first = _outputs(engine)
        name = "model.layers.0.self_attn.k_proj.weight"
        before = engine.get_weights_by_name(name, 2)
        for bad, match in (
            (
                [(name, other[name]), ("model.layers.9.mlp.up_proj.weight", other[name])],
                "no weight",
            ),
            ([(name, other[name]), ("model.norm.weight", other[name])], "shape"),
            ([(name, other[name].to(torch.int32))], "floating point"),
            ([name], r"named_tensors\[0\] must be"),
            ([(name, torch.empty(other[name].shape, device="meta"))], "meta tensor"),
        ):
            ok, message = engine.update_weights_from_tensor(bad)
            assert not ok and re.search(match, message), message
        assert engine.get_weights_by_name(name, 2) == before  # nothing was written
        ok, message = engine.update_weights_from_tensor([], load_format="flattened_bucket")
        assert not ok and "load_format" in message

        items = sorted(other.items())
        half = len(items) // 2
        ok, message = engine.update_weights_from_tensor(items[:half], flush_cache=False)
        assert ok and f"{half} weight" in message, message
        engine.generate(PROMPTS[0], GREEDY)  # runs on half-updated weights, cached
        ok, message = engine.update_weights_from_tensor(items[half:])
        assert ok, message
        again = engine.generate(PROMPTS[0], GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0  # emptied after the last bucket
        assert [again["output_ids"], *_outputs(engine)[1:]] == want_other
        (path,) = tiny_llama_dir.glob("*.safetensors")
        ok, _ = engine.update_weights_from_tensor(list(load_file(str(path)).items()))
        assert ok and _outputs(engine) == want_first
        assert engine.scheduler.check_idle()
