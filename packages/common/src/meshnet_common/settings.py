"""CLI helpers: every flag also reads ``MESHNET_<FLAG>`` from the environment."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from meshnet_common.logs import FORMATS, LEVELS
from meshnet_common.logs import setup_logging as _setup_logging

ENV_PREFIX = "MESHNET_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default and keeps the epilog's examples as written."""


class EnvArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose flags fall back to ``MESHNET_<FLAG>`` env vars; help says so.

    Flags added to argument groups get the same treatment: the env defaults are applied
    to every action just before parsing or printing help.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._env_applied = False

    def _apply_env(self) -> None:
        if self._env_applied:
            return
        self._env_applied = True
        for action in self._actions:
            if (
                not action.option_strings
                or action.dest in ("help", "version")
                or action.help == argparse.SUPPRESS
            ):
                continue
            name = env_name(action.dest)
            action.help = f"{action.help or ''} [env {name}]".strip()
            if name in os.environ:
                raw = os.environ[name]
                if isinstance(action, argparse._StoreTrueAction):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                elif isinstance(action, argparse._AppendAction):
                    action.default = [v for v in raw.split(",") if v]
                else:
                    action.default = action.type(raw) if action.type else raw
                action.required = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._apply_env()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._apply_env()
        return super().format_help()

    def error(self, message: str) -> None:  # one clear line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level", default="info", type=str.lower, choices=LEVELS,
        help="least severe events logged (prompt text appears only at debug)",
    )  # fmt: skip
    group.add_argument(
        "--log-format", default="logfmt", choices=FORMATS,
        help="one line per event: key=value pairs, or one JSON object",
    )  # fmt: skip


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print one clear error line (no traceback) and exit non-zero."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def setup_logging(level: str, fmt: str = "logfmt") -> None:
    _setup_logging(level, fmt)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return parser.parse_args(argv)
