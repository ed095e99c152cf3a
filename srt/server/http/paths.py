"""The local paths a client may name: profiler output under one folder, checkpoints under the
weight-update roots. Paths are taken as given (no ``~`` expansion), resolved with symlinks, and
must land inside their folder; a checkpoint path that does not gets one message whatever the
reason (missing, outside, a file instead of a folder), so the route is no file-system oracle.
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any

from radixlm.srt.config import ServerConfig, split_list
from radixlm.srt.managers.tokenizer_manager import GenerateError

CHECKPOINT_NOT_FOUND = (
    "no checkpoint this server may load at model_path: give the absolute path of a checkpoint "
    "under the server's weight-update folders (--weight-update-roots)"
)


def is_inside(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` is ``folder`` or lies under it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def profile_output_dir(root: str, output_dir: Any) -> str:
    """The folder a ``/start_profile`` writes to: ``output_dir`` (relative to ``root``, or
    absolute inside it), resolved; ``root`` without one. GenerateError 400 otherwise."""
    if output_dir is None:
        return root
    if not isinstance(output_dir, str) or not output_dir or "\0" in output_dir:
        raise GenerateError("output_dir must be a non-empty string", 400, "output_dir")
    if ".." in PurePath(output_dir).parts or output_dir.startswith("~"):
        raise GenerateError(
            "output_dir may not hold '..' or start with '~'", 400, "output_dir", "path_not_allowed"
        )
    resolved = os.path.realpath(os.path.join(root, output_dir))  # an absolute one stays
    if not is_inside(resolved, root):
        raise GenerateError(
            "output_dir must be a folder inside the server's profile folder "
            "(--torch-profiler-dir); give a path relative to it",
            400,
            "output_dir",
            "path_not_allowed",
        )
    return resolved


def weight_update_roots(cfg: ServerConfig, model_dir: str | None) -> list[str]:
    """The folders checkpoints may be loaded from: ``--weight-update-roots``, else the folder
    holding the served model's folder (the model's own folder when that is ``/``)."""
    if cfg.weight_update_roots is not None:
        return [os.path.realpath(p) for p in split_list(cfg.weight_update_roots)]
    if not model_dir:
        return []
    folder = os.path.realpath(model_dir)
    if not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    parent = os.path.dirname(folder)
    return [folder if parent == os.sep else parent]


def checkpoint_path(roots: list[str], model_path: Any) -> str:
    """``model_path`` resolved, when it exists under one of ``roots``; else the one 400."""
    ok = (
        isinstance(model_path, str)
        and os.path.isabs(model_path)
        and "\0" not in model_path
        and ".." not in PurePath(model_path).parts
    )
    resolved = os.path.realpath(model_path) if ok else ""
    if not ok or not any(is_inside(resolved, r) for r in roots) or not os.path.exists(resolved):
        raise GenerateError(CHECKPOINT_NOT_FOUND, 400, "model_path", "model_path_not_found")
    return resolved
