"""Schemathesis over /openapi.json (bounded, deterministic seed) against the HTTP process on
127.0.0.1 over the fake worker: generated bodies from the declared request schemas must never
give a 5xx, an undocumented status code or content type, or a response outside its schema."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
from fake_stack import FakeStack
from test_http_strict import assert_clean

pytestmark = pytest.mark.slow

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance"
)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("ipc"))
    yield s
    s.close()


def test_schemathesis_finds_no_failure(stack: FakeStack, tmp_path) -> None:
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis") or pytest.skip("no schemathesis command")
    r = subprocess.run(
        [
            cli,
            "run",
            stack.url + "/openapi.json",
            "--checks",
            CHECKS,
            "--max-examples",
            "15",
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "10",
            "--phases",
            "examples,fuzzing",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "passed" in r.stdout
    assert_clean(stack.url, stack)
