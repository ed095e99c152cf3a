"""The ``radixlm`` command.

    radixlm serve                                  # the default model on 127.0.0.1:30000
    radixlm serve --model-path ./my-model --port 8000 --api-key KEY
    radixlm generate --prompt "The capital of France is" --max-new-tokens 16

Every ServerConfig field is a flag of both subcommands (``--model`` works as ``--model-path``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from radixlm.srt.config import ServerConfig, add_cli_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixlm", description="radixlm structured-generation runtime"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (native and OpenAI APIs)")
    add_cli_args(serve)
    gen = sub.add_parser("generate", help="generate once in-process and print the result")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")
    add_cli_args(gen)
    return parser


def run_serve(cfg: ServerConfig) -> int:
    from radixlm.srt.server.process.launch import launch_server

    launch_server(cfg)
    return 0


def run_generate(args: argparse.Namespace, cfg: ServerConfig) -> int:
    from radixlm.srt import Engine

    options: dict[str, Any] = {k: v for k, v in vars(cfg).items() if k != "model_path"}
    engine = Engine(model_path=cfg.model_path, **options)
    try:
        prompt = args.prompt
        if args.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        out = engine.generate(
            prompt=prompt,
            sampling_params={
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature,
            },
        )
    finally:
        engine.shutdown()
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        print(out["text"])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:  # bad options: one clear line, no traceback
        print(f"radixlm: error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return run_serve(cfg)
    return run_generate(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
