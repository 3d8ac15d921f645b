"""The `loraserve` command: `loraserve serve [MODEL] [flags]`, in vLLM's spelling (plus TGI's LORA_ADAPTERS)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.core_process import LOG_FORMAT

from .config import ConfigError, add_serve_arguments, resolve_config
from .launch import serve

DESCRIPTION = "One base model, many LoRA adapters, one OpenAI-compatible server."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="Serve a model and its adapters over the OpenAI, vLLM and TGI HTTP APIs.",
        description="Serve a model and its LoRA adapters. Precedence: flags > environment > config file > defaults.",
    )
    add_serve_arguments(serve)
    parser.epilog = "`loraserve serve` options:\n\n" + serve.format_help()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        config = resolve_config(args, os.environ, Path.cwd())
    except ConfigError as exc:
        parser.exit(2, f"loraserve serve: error: {exc}\n")
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    if config.config_file:
        logging.getLogger("loraserve.server").info("Settings from %s", config.config_file)
    try:
        serve(config)
    except (ValueError, OSError) as exc:
        logging.getLogger("loraserve.server").error("Cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
