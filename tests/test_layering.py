"""Imports flow one way (srt/README.md, "The layer map"): checked on the source of every .py file.

Each module of the ``radixlm`` namespace belongs to a *unit*: a package of srt (``srt.scheduler``
for anything under srt/scheduler/), a top-level module of srt (``srt.engine``), ``srt`` itself
(srt/__init__.py, the public face), or a whole top-level package (``lang``, ``radix``, ...).
A unit may import units on a lower layer and itself, nothing on its own layer or above.
The map, top to bottom, and why each unit sits where it does:

====  ==============================  =========================================================
layer unit(s)                         what it may import (besides lower layers' names)
====  ==============================  =========================================================
0     srt.bench                       user tools: the DSL programs, the engine, the server
1     srt.cli, lang                   entry points: the CLI (server + engine), the DSL (Engine)
2     srt                             the public face: lazy ``Engine`` / ``ServerConfig``
3     srt.server, srt.engine          the two front ends: HTTP process, in-process engine
4     srt.managers                    tokenizer manager, detokenizer, the scheduler process
5     srt.scheduler                   event loop, admission, KV manager, grammar manager
6     srt.speculative,                drafters (n-gram, draft model) the scheduler verifies;
      srt.disaggregation              KV transfer engines and the prefill-decode handshake
7     srt.executor                    model runner, forward batch, KV pools, CUDA graphs
8     srt.models                      architectures and weight loaders (kernels only)
9     srt.messages, srt.sampling,     wire messages; sampling params and sampler; tool-call
      srt.parsers, srt.distributed,   and reasoning parsers of model outputs (no srt deps);
      srt.observability               tensor-parallel groups and collectives (torch only);
                                      request traces and the request dump (the hooks of
                                      the three processes read requests by duck typing)
10    srt.config                      frozen config dataclasses every layer above reads
11    radix, grammar                  libraries: never import srt or lang; the radix tree's
                                      HiCache-aware variant builds on the tiers below it
12    hicache                         host and disk KV tiers (pools, copies, page store)
13    kernels                         attention, bitmask, fused and int4/int8 CPU ops
====  ==============================  =========================================================

Inside srt.server the same rule holds between its packages (``SERVER_LAYERS``), top to bottom:
``process`` (launch and supervision, which start the app), ``app`` (assembles the routers), the
route packages of the dialects ``native``, ``openai`` and ``anthropic`` (one layer: a dialect
never imports another), ``chat`` (the chat pipeline the chat dialects share) and ``http``
(errors, middleware, streaming, OpenAPI, metrics, the shared dependencies). What two dialects
both need goes down into chat/ or http/.

Imports under ``if TYPE_CHECKING:`` are ignored (annotations only, never run); imports inside
functions count. Outside radixlm (tests/, examples/) only one rule applies: the top-level
folders are imported through ``radixlm.`` (PyPI has unrelated packages named srt, lang,
grammar and kernels).

The layer table of srt/README.md shows, per unit, what it imports today; the test below checks
that column against the code, and its failure message gives the line to write.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("srt", "lang", "radix", "grammar", "hicache", "kernels")
LIBRARIES = ("radix", "grammar", "hicache", "kernels")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("srt.bench",),
    ("srt.cli", "lang"),
    ("srt",),
    ("srt.server", "srt.engine"),
    ("srt.managers",),
    ("srt.scheduler",),
    ("srt.speculative", "srt.disaggregation"),
    ("srt.executor",),
    ("srt.models",),
    ("srt.messages", "srt.sampling", "srt.parsers", "srt.distributed", "srt.observability"),
    ("srt.config",),
    ("radix", "grammar"),
    ("hicache",),
    ("kernels",),
)
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
SERVER_DIALECTS = ("srt.server.native", "srt.server.openai", "srt.server.anthropic")
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("srt.server.process",),
    ("srt.server.app",),
    SERVER_DIALECTS,
    ("srt.server.chat",),
    ("srt.server.http",),
)
SERVER_LAYER_OF = {part: depth for depth, parts in enumerate(SERVER_LAYERS) for part in parts}
SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}
SRT_README = ROOT / "srt" / "README.md"
NOTHING = "nothing of radixlm"  # the imports column of a unit that imports no other unit


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    source: str  # the importing module ("radixlm.srt.models.llama", "tests.test_x")
    target: str  # the imported module, resolved to a module that exists where possible


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package __init__) of a file below root."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in TOP_PACKAGES:
        parts.insert(0, "radixlm")
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def python_files(root: Path) -> Iterator[Path]:
    """Every .py file below root, sorted, not walking into ``SKIP_DIRS`` (a virtual environment
    under the checkout holds tens of thousands of files)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    yield from sorted(found)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Absolute names of everything a module imports, skipping ``if TYPE_CHECKING:`` bodies."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[int, str, list[str]]] = []  # (line, module, imported names)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        for child in node.orelse:  # the else branch of `if TYPE_CHECKING:` does run
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, alias.name, []) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:  # relative: `from ..x import y` in package a.b.c means a.b.x
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, module] if module else base)
        self.found.append((node.lineno, module, [a.name for a in node.names if a.name != "*"]))


def scan(root: Path) -> list[Import]:
    """Every import of every .py file below root."""
    modules = {path: module_name(root, path) for path in python_files(root)}
    known = {name for name, _ in modules.values()}
    imports: list[Import] = []
    for path, (module, is_package) in modules.items():
        collector = _ImportCollector(module, is_package)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        for line, target, names in collector.found:
            # `from radixlm import srt` imports the module radixlm.srt; `from m import f` only m
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            for name in submodules or [target]:
                imports.append(Import(path, line, module, name))
    return imports


def unit_of(module: str) -> str | None:
    """The layering unit of a radixlm module; None outside the radixlm namespace."""
    parts = module.split(".")
    if parts[0] != "radixlm" or len(parts) < 2:
        return None
    if parts[1] == "srt":
        return "srt" if len(parts) == 2 else f"srt.{parts[2]}"
    return parts[1]


def server_part_of(module: str) -> str | None:
    """The package (or top-level module) of srt.server a module is in: ``srt.server.native``
    for radixlm.srt.server.native.generate; None outside srt.server and for the package itself."""
    parts = module.split(".")
    if parts[:3] != ["radixlm", "srt", "server"] or len(parts) < 4:
        return None
    return f"srt.server.{parts[3]}"


def _check_server(imp: Import) -> str | None:
    """Why an import inside srt.server breaks the server's own map, or None."""
    source, target = server_part_of(imp.source), server_part_of(imp.target)
    if source is None or target is None or source == target:
        return None
    for part in (source, target):
        if part not in SERVER_LAYER_OF:
            return f"{part} is on no layer: place it in SERVER_LAYERS (tests/test_layering.py)"
    if source in SERVER_DIALECTS and target in SERVER_DIALECTS:
        return (
            f"back-edge: the route package {source} may not import the route package {target}: "
            "move what both need down into srt/server/chat/ (the shared chat pipeline) or "
            "srt/server/http/ (errors, dependencies, streaming), and import it from there"
        )
    if SERVER_LAYER_OF[target] <= SERVER_LAYER_OF[source]:
        return (
            f"back-edge: {source} (server layer {SERVER_LAYER_OF[source]}) may not import "
            f"{target} (server layer {SERVER_LAYER_OF[target]}): move the code it needs down "
            "(SERVER_LAYERS in tests/test_layering.py)"
        )
    return None


def _where(root: Path, imp: Import) -> str:
    return f"{imp.path.relative_to(root)}:{imp.line}: {imp.source} imports {imp.target}"


def _check_one(imp: Import) -> str | None:
    """Why this import breaks the layering, or None."""
    if imp.target.split(".")[0] in TOP_PACKAGES:
        return "import it through the radixlm namespace (radixlm." + imp.target + ")"
    source, target = unit_of(imp.source), unit_of(imp.target)
    if source == target == "srt.server":
        return _check_server(imp)
    if source is None or target is None or source == target:
        return None
    if source in LIBRARIES and (target == "srt" or target.startswith("srt.")):
        return f"the library {source} imports the serving runtime"
    for unit in (source, target):
        if unit not in LAYER_OF:
            return f"{unit} is on no layer: place it in LAYERS (tests/test_layering.py)"
    if LAYER_OF[target] <= LAYER_OF[source]:
        return (
            f"back-edge: {source} (layer {LAYER_OF[source]}) may not import {target} "
            f"(layer {LAYER_OF[target]})"
        )
    return None


def layering_violations(root: Path, imports: Iterable[Import] | None = None) -> list[str]:
    """One line per import that breaks the layering, as ``path:line: ...: why``."""
    found = []
    for imp in scan(root) if imports is None else imports:
        why = _check_one(imp)
        if why is not None:
            found.append(f"{_where(root, imp)}: {why}")
    return found


# --- the real tree --------------------------------------------------------------------------


@functools.cache
def _tree_imports() -> tuple[Import, ...]:
    return tuple(scan(ROOT))


def test_the_tree_follows_the_layer_map() -> None:
    violations = layering_violations(ROOT, _tree_imports())
    assert violations == [], "imports against the layer map:\n" + "\n".join(violations)


@pytest.mark.parametrize("lib", LIBRARIES)
def test_library_never_imports_srt(lib: str) -> None:
    files = list(python_files(ROOT / lib))
    assert files, f"no sources under {lib}/"
    offenders = [
        _where(ROOT, imp)
        for imp in _tree_imports()
        if unit_of(imp.source) == lib and (unit_of(imp.target) or "").split(".")[0] == "srt"
    ]
    assert offenders == []


def test_every_radixlm_package_is_on_a_layer() -> None:
    units = {unit_of(module_name(ROOT, path)[0]) for path in python_files(ROOT)} - {None}
    assert units, "the scan found no radixlm module"
    assert sorted(units - set(LAYER_OF)) == []


def test_every_server_package_is_on_a_server_layer() -> None:
    parts = {server_part_of(module_name(ROOT, path)[0]) for path in python_files(ROOT / "srt")}
    assert {"srt.server.native", "srt.server.http"} <= parts - {None}
    assert sorted(parts - {None} - set(SERVER_LAYER_OF)) == []


def test_importing_the_libraries_loads_no_srt_module() -> None:
    # The run-time view of the same rule: catches imports the source scan cannot see.
    code = (
        "import sys, radixlm.radix, radixlm.grammar, radixlm.hicache, radixlm.kernels\n"
        "print(sorted(m for m in sys.modules if m.startswith('radixlm.srt')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def imported_units(imports: Iterable[Import]) -> dict[str, set[str]]:
    """Unit -> the other units it imports."""
    found: dict[str, set[str]] = {unit: set() for unit in LAYER_OF}
    for imp in imports:
        source, target = unit_of(imp.source), unit_of(imp.target)
        if source is not None and target is not None and source != target:
            found.setdefault(source, set()).add(target)
    return found


def imports_cell(units: Iterable[str]) -> str:
    return ", ".join(f"`{unit}`" for unit in sorted(units)) or NOTHING


def layer_table(markdown: str) -> dict[str, tuple[int, set[str]]]:
    """Rows of a layer table: unit (the first `code` of the unit cell) -> (layer, imported units).

    A row is ``| layer | `unit` (where) | what it is | `a`, `b` |``; the last cell lists the
    imported units in backticks, or says "nothing of radixlm"."""
    rows = {}
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            unit = re.findall(r"`([^`]+)`", cells[1])[0]
            rows[unit] = (int(cells[0]), set(re.findall(r"`([^`]+)`", cells[3])))
    return rows


def layer_table_errors(markdown: str, imports: dict[str, set[str]]) -> list[str]:
    """What a layer table gets wrong against LAYERS and the imports found in the code."""
    rows = layer_table(markdown)
    errors = [f"{unit}: no such unit in LAYERS" for unit in sorted(set(rows) - set(LAYER_OF))]
    for unit, layer in LAYER_OF.items():
        if unit not in rows:
            errors.append(f"{unit}: no row (layer {layer}, imports {imports_cell(imports[unit])})")
            continue
        row_layer, row_imports = rows[unit]
        if row_layer != layer:
            errors.append(f"{unit}: the row says layer {row_layer}, LAYERS says {layer}")
        if row_imports != imports[unit]:
            errors.append(f"{unit}: the imports column should read {imports_cell(imports[unit])}")
    return errors


def test_the_srt_readme_layer_table_is_true() -> None:
    errors = layer_table_errors(SRT_README.read_text(), imported_units(_tree_imports()))
    assert errors == [], "srt/README.md, the layer table:\n" + "\n".join(errors)


def test_the_bitmask_apply_is_the_kernels_one() -> None:
    # grammar/ applies masks with the kernel, not with a copy of it
    from radixlm.grammar import apply_token_bitmask_inplace
    from radixlm.kernels import bitmask

    assert apply_token_bitmask_inplace is bitmask.apply_token_bitmask_inplace


# --- the checker itself, on a synthetic tree ------------------------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC_BASE = {
    "srt/__init__.py": "",
    "srt/config.py": "",
    "srt/executor/__init__.py": "",
    "srt/executor/forward_batch.py": "from radixlm.srt.config import X\n",
    "srt/models/__init__.py": "",
    "srt/scheduler/__init__.py": "",
    "srt/scheduler/kv.py": "",
    "radix/__init__.py": "",
}


def test_a_clean_synthetic_tree_passes(tmp_path: Path) -> None:
    _write_tree(
        tmp_path,
        {
            **SYNTHETIC_BASE,
            "srt/models/llama.py": (
                "from typing import TYPE_CHECKING\n"
                "from radixlm.srt import config\n"  # downward: models -> config
                "if TYPE_CHECKING:\n"
                "    from radixlm.srt.executor.forward_batch import ForwardBatch\n"
                "else:\n"
                "    from . import other\n"
            ),
            "srt/models/other.py": "from ..config import Y\n",
        },
    )
    assert layering_violations(tmp_path) == []


@pytest.mark.parametrize(
    ("line", "target"),
    [
        ("from radixlm.srt.executor.forward_batch import ForwardBatch", "executor.forward_batch"),
        ("from ..executor.forward_batch import ForwardBatch", "executor.forward_batch"),
        ("from .. import executor", "executor"),
        ("import radixlm.srt.scheduler.kv as kv", "scheduler.kv"),
        ("from radixlm import srt", "srt"),
        ("def f():\n    from radixlm.srt.scheduler import kv", "scheduler.kv"),
        ("if TYPE_CHECKING:\n    pass\nelse:\n    import radixlm.srt.executor", "executor"),
    ],
)
def test_a_synthetic_back_edge_fails(tmp_path: Path, line: str, target: str) -> None:
    _write_tree(tmp_path, {**SYNTHETIC_BASE, "srt/models/llama.py": line + "\n"})
    violations = layering_violations(tmp_path)
    expected = "radixlm.srt" if target == "srt" else f"radixlm.srt.{target}"
    assert len(violations) == 1, violations
    assert violations[0].startswith(f"srt/models/llama.py:{line.count(chr(10)) + 1}: ")
    layer = LAYER_OF["srt.models"]
    assert f"imports {expected}: back-edge: srt.models (layer {layer})" in violations[0]


def test_a_synthetic_library_importing_srt_fails(tmp_path: Path) -> None:
    _write_tree(tmp_path, {**SYNTHETIC_BASE, "radix/tree.py": "from radixlm import srt\n"})
    assert layering_violations(tmp_path) == [
        "radix/tree.py:1: radixlm.radix.tree imports radixlm.srt: "
        "the library radix imports the serving runtime"
    ]


def test_a_synthetic_bare_top_level_import_fails(tmp_path: Path) -> None:
    _write_tree(tmp_path, {**SYNTHETIC_BASE, "tests/test_x.py": "import grammar.base\n"})
    (violation,) = layering_violations(tmp_path)
    assert "radixlm.grammar.base" in violation


def test_a_wrong_layer_table_is_reported() -> None:
    imports = {unit: set() for unit in LAYER_OF}
    imports["srt.models"] = {"kernels", "srt.config"}
    rows = [f"| {layer} | `{unit}` | x | {NOTHING} |" for unit, layer in LAYER_OF.items()]
    table = "\n".join(rows)
    assert layer_table_errors(table, imports) == [
        "srt.models: the imports column should read `kernels`, `srt.config`"
    ]
    fixed = table.replace(
        f"`srt.models` | x | {NOTHING}", "`srt.models` | x | `srt.config`, `kernels`"
    )
    assert layer_table_errors(fixed, imports) == []
    moved = fixed.replace("| 13 | `kernels`", "| 12 | `kernels`").replace(
        "| 10 | `srt.config` |", "|"
    )
    assert layer_table_errors(moved, imports) == [
        "srt.config: no row (layer 10, imports nothing of radixlm)",
        "kernels: the row says layer 12, LAYERS says 13",
    ]


def test_a_synthetic_unplaced_unit_fails(tmp_path: Path) -> None:
    _write_tree(tmp_path, {**SYNTHETIC_BASE, "srt/newpkg/__init__.py": "import radixlm.srt\n"})
    (violation,) = layering_violations(tmp_path)
    assert "srt.newpkg is on no layer" in violation


SYNTHETIC_SERVER = {
    **SYNTHETIC_BASE,
    "srt/server/__init__.py": "",
    "srt/server/app.py": "from radixlm.srt.server.native import generate\n",
    "srt/server/http/__init__.py": "",
    "srt/server/http/deps.py": "",
    "srt/server/chat/__init__.py": "",
    "srt/server/chat/plan.py": "from radixlm.srt.server.http import deps\n",
    "srt/server/native/__init__.py": "",
    "srt/server/native/generate.py": "from radixlm.srt.server.http.deps import get_tm\n",
    "srt/server/openai/__init__.py": "",
    "srt/server/openai/chat.py": "from ..chat.plan import chat_plan\n",
}


def test_a_clean_synthetic_server_passes(tmp_path: Path) -> None:
    _write_tree(tmp_path, SYNTHETIC_SERVER)
    assert layering_violations(tmp_path) == []


@pytest.mark.parametrize(
    ("rel", "line", "expected"),
    [
        (
            "srt/server/native/score.py",
            "from radixlm.srt.server.openai.chat import check_model",
            "the route package srt.server.native may not import the route package "
            "srt.server.openai: move what both need down into srt/server/chat/",
        ),
        (
            "srt/server/openai/chat.py",
            "from ..native.generate import get_tm",
            "the route package srt.server.openai may not import the route package "
            "srt.server.native",
        ),
        (
            "srt/server/chat/plan.py",
            "def f():\n    from radixlm.srt.server.openai import chat",
            "srt.server.chat (server layer 3) may not import srt.server.openai (server layer 2)",
        ),
        (
            "srt/server/http/deps.py",
            "from radixlm.srt.server import app",
            "srt.server.http (server layer 4) may not import srt.server.app (server layer 1)",
        ),
    ],
)
def test_a_synthetic_server_back_edge_fails(
    tmp_path: Path, rel: str, line: str, expected: str
) -> None:
    _write_tree(tmp_path, {**SYNTHETIC_SERVER, rel: line + "\n"})
    (violation,) = layering_violations(tmp_path)
    assert violation.startswith(f"{rel}:{line.count(chr(10)) + 1}: ")
    assert expected in violation


def test_a_synthetic_unplaced_server_package_fails(tmp_path: Path) -> None:
    _write_tree(
        tmp_path,
        {**SYNTHETIC_SERVER, "srt/server/grpc/__init__.py": "import radixlm.srt.server.http\n"},
    )
    (violation,) = layering_violations(tmp_path)
    assert "srt.server.grpc is on no layer: place it in SERVER_LAYERS" in violation
