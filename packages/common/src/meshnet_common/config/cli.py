"""CLI helpers: every flag also reads ``MESHNET_<FLAG>`` from the environment."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from meshnet_common.logs import FORMATS, LEVELS
from meshnet_common.logs import setup_logging as _setup_logging

ENV_PREFIX = "MESHNET_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default (when it has one); in descriptions and epilogs, wraps plain
    lines but keeps indented ones (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if not line.strip() or line.startswith(" "):
                lines.append(indent + line)
            else:
                lines.append(textwrap.fill(line, width, initial_indent=indent,
                                           subsequent_indent=indent))  # fmt: skip
        return "\n".join(lines)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" not in text
            and action.option_strings
            and default not in (None, False, [], argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


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
                if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
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
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def package_version(distribution: str) -> str:
    """The installed version of ``distribution``, or "unknown" when run from a bare tree."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_version_flag(parser: argparse.ArgumentParser, distribution: str) -> None:
    """``--version``: the program name and its package's installed version."""
    parser.add_argument(
        "--version", action="version", version=f"{parser.prog} {package_version(distribution)}"
    )


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
