"""grammar/ is a library: no module in it imports the serving runtime (radixlm.srt). Of the
other radixlm packages it uses only kernels/ (the bitmask apply), which never imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

GRAMMAR_DIR = Path(__file__).resolve().parents[2] / "grammar"
KERNELS_DIR = GRAMMAR_DIR.parent / "kernels"


def _imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against radixlm.grammar
                base = (
                    "radixlm.grammar".rsplit(".", node.level - 1)[0]
                    if node.level > 1
                    else "radixlm.grammar"
                )
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names += [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
    return names


def test_grammar_never_imports_srt():
    files = sorted(GRAMMAR_DIR.glob("**/*.py"))
    assert len(files) >= 8
    offenders = {
        str(path.relative_to(GRAMMAR_DIR)): name
        for path in files
        for name in _imported_modules(path)
        if name == "radixlm.srt" or name.startswith("radixlm.srt.") or name.split(".")[0] == "srt"
    }
    assert offenders == {}


def test_grammar_uses_only_kernels_of_the_other_packages():
    others = {
        name.split(".")[1]
        for path in GRAMMAR_DIR.glob("**/*.py")
        for name in _imported_modules(path)
        if name.startswith("radixlm.") and not name.startswith("radixlm.grammar")
    }
    assert others == {"kernels"}
    back = [
        name
        for path in KERNELS_DIR.glob("**/*.py")
        for name in _imported_modules(path)
        if "grammar" in name.split(".") or name.startswith("radixlm.srt")
    ]
    assert back == []


def test_the_bitmask_apply_is_the_kernels_one():
    from radixlm.grammar import apply_token_bitmask_inplace
    from radixlm.kernels import bitmask

    assert apply_token_bitmask_inplace is bitmask.apply_token_bitmask_inplace


def test_the_scan_sees_srt_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from radixlm import srt\nimport radixlm.srt.config\nfrom ..srt import x\n")
    found = [n for n in _imported_modules(sample) if "srt" in n]
    assert "radixlm.srt" in found and "radixlm.srt.config" in found and "radixlm.srt.x" in found
