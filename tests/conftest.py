"""Shared test set-up: the `gpu` marker skips without CUDA; one cache folder per session."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

# Byte-code caching on, also where the environment turns it off (PYTHONDONTWRITEBYTECODE): else
# every test process, and every server and rank it starts, compiles the project from source
# again, and pytest rewrites every test module again (collection alone: 21 -> 11 s of CPU per
# worker once cached, measured on the 2-core machine).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# Converted default-model weights are cached here for the whole run (and reused across runs
# when RADIXLM_CACHE_DIR is set by the caller).
def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU, Triton kernels run (and are tested) under the Triton interpreter; this must be
# set before anything imports triton.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault(
    "RADIXLM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "radixlm-test-cache")
)


# One intra-op thread per process (``RADIXLM_TEST_THREADS`` to change it), in the test process and,
# through OMP_NUM_THREADS, in the servers and ranks it starts (TP ranks set their own): the tests'
# models are small and the suite runs two workers, so every core is busy; two threads' hand-offs
# then cost more than they save, many times more when the other core is taken.
_TEST_THREADS = os.environ.get("RADIXLM_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", _TEST_THREADS)


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(_TEST_THREADS))
    _share_default_tls_context()
    if config.getoption("markexpr", "") == "not slow":  # the quick pass: see tests/quick.py
        os.environ["RADIXLM_TEST_QUICK"] = "1"


def _share_default_tls_context() -> None:
    """Every httpx client of the session (``httpx.get`` and the like, openai's and anthropic's
    clients) takes one default TLS context instead of loading certifi's CA bundle again: about
    45 ms of CPU per client on a CI-like machine, several per test, for servers that speak plain
    HTTP on 127.0.0.1. Contexts asked for with other settings are built as httpx builds them."""
    import functools

    from httpx._transports import default

    build = getattr(default, "create_ssl_context", None)
    if build is None:  # another httpx layout: clients build their own contexts, as before
        return

    @functools.cache
    def shared_default():
        return build(verify=True, cert=None, trust_env=True)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared_default()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


# A module whose top-level ``pytestmark`` marks it slow as a whole: under ``-m "not slow"`` every
# one of its tests would be deselected, so it is not imported at all (some import heavy clients).
_WHOLE_MODULE_SLOW = re.compile(
    r"^pytestmark = (pytest\.mark\.slow|\[[^\n]*pytest\.mark\.slow[^\n]*\])$", re.M
)


def pytest_ignore_collect(collection_path, config):
    if config.getoption("markexpr", "") != "not slow":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return bool(_WHOLE_MODULE_SLOW.search(collection_path.read_text())) or None


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiers_always_load(monkeypatch):
    """Every host and disk hit is loaded. The cache weighs a load against recomputing by
    measured rates; a tiny model recomputes so cheaply that on a busy CPU reading its pages is
    judged slower and skipped, and a test about the loaded pages would see none."""
    from radixlm.radix.hicache_stats import TierStats

    monkeypatch.setattr(TierStats, "load_pays_off", lambda self, *args: True)
    monkeypatch.setattr(TierStats, "disk_pays_off", lambda self, *args: True)


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded SmolLM2-135M-Instruct, converted once into the test cache."""
    from radixlm.srt.models.default_model import resolve_model_path

    return resolve_model_path(None)


def write_tiny_model(path, tokenizer, architecture="llama", **shape):
    """Saves a randomly initialised 2-layer model (seed 0) of ``architecture`` (``"llama"`` or
    ``"qwen2"``) over ``tokenizer`` into ``path``; ``shape`` overrides its config's fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[architecture]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_class(config_class(**{**fields, **shape})).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="session")
def tiny_model_writer():
    """``write_tiny_model`` for tests that bring their own tokenizer, architecture or shape."""
    return write_tiny_model


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer over ids ``0 .. 511`` built in memory (``t<id>``; ``t0`` unknown
    and bos, ``t1`` eos): tiny models for machines without the default model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(512)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
        unk_token="t0",
        eos_token="t1",
        bos_token="t0",
    )


@pytest.fixture(scope="session")
def offline_tiny_llama_dir(tmp_path_factory, word_tokenizer):
    """``tiny_llama_dir``'s model over ``word_tokenizer``: needs no default model (tests that
    feed token ids and run on GPU machines, which do not have it)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-offline"), word_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir):
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer (fast engine tests)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tok)


@pytest.fixture(scope="session")
def smol_engine(default_model_dir):
    """One Engine over the default model for the whole session."""
    from radixlm.srt import Engine

    engine = Engine(max_total_tokens=8192, log_level="warning")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """Starts a server of the module's own (one that it stops, kills, pauses or updates, or whose
    configuration no other module shares): ``radixlm serve`` with the given CLI arguments on
    127.0.0.1 (a fresh port, its log under the test's temporary folder); every server it started
    is stopped when the module ends: ``server = start_server("--max-total-tokens", "4096")``.
    Modules that only send requests take ``shared_server`` instead."""
    from radixlm.srt.server.process.server_process import ServerProcess

    started = []

    def start(*args: str, **kwargs):
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess([str(a) for a in args], log_path=log, **kwargs)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


# At most this many shared servers run at once (about 2.3 GiB resident each on the default
# model); the least recently used one that no running module holds is stopped beyond it.
MAX_SHARED_SERVERS = int(os.environ.get("RADIXLM_TEST_MAX_SERVERS", "2"))


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    """The session's shared servers, one per configuration, stopped when the session ends."""
    from server_pool import ServerPool

    pool = ServerPool(tmp_path_factory, MAX_SHARED_SERVERS)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def shared_server(server_pool):
    """``radixlm serve`` with the given CLI arguments, shared by every module that asks for the
    same configuration (arguments and environment) and started once per session:
    ``server = shared_server("--max-total-tokens", 8192)``. The module gets it healthy, with no
    request left from an earlier module and its prefix cache flushed. A module that changes a
    server in ways another module would see (stops, kills or pauses it, updates its weights)
    takes ``start_server``."""
    holder = object()

    def lease(*args: str):
        return server_pool.lease(holder, [str(a) for a in args])

    yield lease
    server_pool.release(holder)


DEFAULT_SERVER_ARGS = ("--max-total-tokens", 8192)


@pytest.fixture(scope="module")
def default_server(shared_server):
    """`radixlm serve` on the default model (KV pool of 8192 tokens), shared by the session."""
    return shared_server(*DEFAULT_SERVER_ARGS)
