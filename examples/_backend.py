"""Shared by the examples: ``--url`` for a server, otherwise an in-process Engine."""

from __future__ import annotations

import argparse

import radixlm.lang as rl


def example_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url",
        help="a radixlm (or SGLang) server, e.g. http://127.0.0.1:30000 "
        "(default: the default model in this process)",
    )
    parser.add_argument("--api-key", help="the server's API key, if it requires one")
    parser.add_argument(
        "--model-path",
        help="local model for the in-process engine (default: SmolLM2-135M-Instruct)",
    )
    return parser


def connect(args: argparse.Namespace) -> rl.BaseBackend:
    """A RuntimeEndpoint for ``--url``, else a Runtime (an Engine owned by the backend)."""
    if args.url:
        return rl.RuntimeEndpoint(args.url, api_key=args.api_key)
    return rl.Runtime(args.model_path, log_level="warning")


def print_usage(backend: rl.BaseBackend) -> None:
    u = backend.usage.snapshot()
    print(
        f"\n{u.num_requests} requests, {u.prompt_tokens} prompt tokens of which "
        f"{u.cached_tokens} came from the prefix cache ({u.cache_hit_rate:.0%}), "
        f"{u.completion_tokens} generated"
    )
