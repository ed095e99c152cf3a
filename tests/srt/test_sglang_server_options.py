"""Server options SGLang users pass: --chat-template (a Jinja file or the template text
replaces the tokenizer's template in every process that formats chats: the engine's runner and
the HTTP process's tokenizer), --cuda-graph-max-bs, and the flags accepted as they are."""

from __future__ import annotations

import pytest

from radixlm.srt.config import config_from_kwargs, read_chat_template
from radixlm.srt.managers.detokenizer_process import load_server_tokenizer

TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
EXPECTED = "<<system>>Be brief.\n<<user>>Hi\n<<assistant>>"


def test_a_file_or_the_text_is_read_and_anything_else_is_refused(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither"):
        read_chat_template("chatml")  # a name, no such file
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        read_chat_template("{% for m in messages %}{{ m }}")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ unclosed", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jinja"):
        read_chat_template(str(bad))
    with pytest.raises(ValueError, match="chat_template"):
        config_from_kwargs(chat_template="no-such-template")
    # transformers' own {% generation %} tag compiles
    read_chat_template("{% for m in messages %}{% generation %}x{% endgeneration %}{% endfor %}")


def test_the_server_tokenizer_and_the_engine_use_the_template(tiny_llama_dir, tmp_path) -> None:
    from radixlm.srt import Engine

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    cfg = config_from_kwargs(model_path=str(tiny_llama_dir), chat_template=str(path))
    tok = load_server_tokenizer(cfg)
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == EXPECTED
    plain = load_server_tokenizer(config_from_kwargs(model_path=str(tiny_llama_dir)))
    assert plain.chat_template != TEMPLATE
    with Engine(str(tiny_llama_dir), chat_template=TEMPLATE, log_level="warning") as engine:
        assert engine.apply_chat_template(MESSAGES) == EXPECTED


def test_sglang_permission_flags_are_accepted() -> None:
    """``--trust-remote-code`` and ``--enable-metrics`` come with SGLang command lines and
    ``sgl.Engine(...)`` calls; both describe what this server does anyway."""
    from radixlm.srt.cli import build_parser

    args = build_parser().parse_args(["serve", "--trust-remote-code", "--enable-metrics"])
    assert args.trust_remote_code and args.enable_metrics
    assert config_from_kwargs(trust_remote_code=True, enable_metrics=True).trust_remote_code


def test_cuda_graph_max_bs_caps_the_captured_batches() -> None:
    from radixlm.srt.executor.model_runner import MAX_GRAPH_BATCH, graph_max_batch

    assert graph_max_batch(config_from_kwargs()) == min(
        config_from_kwargs().max_running_requests, MAX_GRAPH_BATCH
    )
    assert graph_max_batch(config_from_kwargs(cuda_graph_max_bs=64)) == 64
    assert graph_max_batch(config_from_kwargs(cuda_graph_max_bs=64, max_running_requests=8)) == 8
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        config_from_kwargs(cuda_graph_max_bs=0)


def test_more_sglang_launch_flags_are_served_or_refused_naming_them(monkeypatch, caplog) -> None:
    """Flags common in SGLang launch scripts: accepted where they describe this server anyway,
    mapped where a counterpart exists, refused naming the option where none does."""
    from radixlm.srt.cli import build_parser

    flags = ["--enable-cache-report", "--skip-server-warmup", "--enable-p2p-check"]
    args = build_parser().parse_args(["serve", *flags, "--dp-size", "1", "--enable-torch-compile"])
    assert args.enable_cache_report and args.skip_server_warmup and args.dp_size == 1
    assert config_from_kwargs(data_parallel_size=1).dp_size == 1
    with pytest.raises(ValueError, match="dp_size must be 1.*sglang-router"):
        config_from_kwargs(dp_size=2)
    # SGLang's grammar engine: the one here that serves the same grammars, said at start
    args = build_parser().parse_args(["serve", "--grammar-backend", "xgrammar"])
    with caplog.at_level("WARNING"):
        assert config_from_kwargs(grammar_backend=args.grammar_backend).grammar_backend == (
            "llguidance"
        )
    assert "xgrammar is not included" in caplog.text
    # SGLang's file storage backend is the disk tier, in its folder
    on = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    assert config_from_kwargs(**on).hicache_storage_dir == "/tmp/hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/data/kv")
    assert config_from_kwargs(**on).hicache_storage_dir == "/data/kv"
    assert config_from_kwargs(**on, hicache_storage_dir="/x").hicache_storage_dir == "/x"
    with pytest.raises(ValueError, match="hicache_storage_backend 'mooncake' is not available"):
        config_from_kwargs(enable_hierarchical_cache=True, hicache_storage_backend="mooncake")
    # SGLang's HiCache I/O flags: its prefetch policies are served; its kernel I/O backend and
    # page-first layouts are taken as the direct, layer-first ones this server has, said at start
    args = build_parser().parse_args(
        ["serve", "--hicache-storage-prefetch-policy", "wait_complete"]
        + ["--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"]
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        cfg = config_from_kwargs(
            hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
            hicache_io_backend=args.hicache_io_backend,
            hicache_mem_layout=args.hicache_mem_layout,
        )
    assert cfg.hicache_storage_prefetch_policy == "wait_complete"
    assert (cfg.hicache_io_backend, cfg.hicache_mem_layout) == ("direct", "layer_first")
    assert "hicache_io_backend kernel is taken as direct" in caplog.text
    assert "hicache_mem_layout page_first is taken as layer_first" in caplog.text
    with pytest.raises(ValueError, match="hicache_storage_prefetch_policy must be one of"):
        config_from_kwargs(hicache_storage_prefetch_policy="eager")
    # request logs at SGLang's levels, formats and targets
    args = build_parser().parse_args(
        ["serve", "--log-requests", "--log-requests-level", "1", "--log-requests-format", "json"]
        + ["--log-requests-target", "stdout", "/var/log/x"]
    )
    assert (args.log_requests_level, args.log_requests_format) == (1, "json")
    assert args.log_requests_target == ["stdout", "/var/log/x"]


def test_default_priority_value_ranks_requests_that_set_none() -> None:
    from radixlm.srt.sampling.params import SamplingParams
    from radixlm.srt.scheduler.queue_order import LOWEST_RANK, PriorityRule
    from radixlm.srt.scheduler.req import Req

    cfg = config_from_kwargs(enable_priority_scheduling=True, default_priority_value=5)
    rule = PriorityRule.from_config(cfg)
    plain = Req(rid="a", prompt_ids=[1], params=SamplingParams())
    urgent = Req(rid="b", prompt_ids=[1], params=SamplingParams(), priority=9)
    assert rule.rank(plain) == -5 and rule.rank(urgent) == -9  # higher values first
    assert [r.rid for r in rule.order([plain, urgent])] == ["b", "a"]
    low = PriorityRule.from_config(config_from_kwargs(enable_priority_scheduling=True))
    assert low.rank(plain) == LOWEST_RANK
