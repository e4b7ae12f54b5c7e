"""CLI helpers: every flag also reads ``MESHNET_<FLAG>`` from the environment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

ENV_PREFIX = "MESHNET_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose flags fall back to ``MESHNET_<FLAG>`` env vars; help says so."""

    def add_argument(self, *args, **kwargs):  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest not in ("help", "version"):
            name = env_name(action.dest)
            action.help = f"{action.help or ''} [env {name}]".strip()
            if name in os.environ:
                raw = os.environ[name]
                if isinstance(action, argparse._StoreTrueAction):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                else:
                    action.default = action.type(raw) if action.type else raw
                action.required = False
        return action

    def error(self, message: str) -> None:  # one clear line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print one clear error line (no traceback) and exit non-zero."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    # One line per request from the HTTP client is noise at info level.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return parser.parse_args(argv)
