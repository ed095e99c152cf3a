"""Who may reach the server and where it may write: the Host header names served and the
profiler's folder, read from the config by the HTTP process and the scheduler."""

from __future__ import annotations

import ipaddress
import os
import tempfile

from radixlm.srt.config.options import LOOPBACK_HOSTS, ServerConfig


def split_list(value: str) -> list[str]:
    """The items of a comma-separated flag value, stripped, without empty ones."""
    return [item.strip() for item in value.split(",") if item.strip()]


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_host_names(cfg: ServerConfig) -> frozenset[str] | None:
    """The Host header names served (lower case, no port); None when any is (``*``, or a
    non-loopback bind without ``allowed_hosts``)."""
    if cfg.allowed_hosts is None:
        if not is_loopback_host(cfg.host):
            return None
        return frozenset({*LOOPBACK_HOSTS, cfg.host.lower().strip("[]")})
    names = split_list(cfg.allowed_hosts)
    if "*" in names:
        return None
    return frozenset(n.lower().strip("[]") for n in names)


def torch_profiler_dir(cfg: ServerConfig) -> str:
    """The folder of profiler traces: ``torch_profiler_dir``, else the environment's, else the
    system temp folder; absolute, symlinks resolved."""
    folder = cfg.torch_profiler_dir
    for name in ("RADIXLM_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR"):
        folder = folder or os.environ.get(name)
    return os.path.realpath(folder or tempfile.gettempdir())
