"""CLI helpers shared by the services: the parser, --version, one-line failures."""

from __future__ import annotations

import argparse
import sys
import textwrap

from meshnet_common.logs import setup_logging as _setup_logging


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


class FlagParser(argparse.ArgumentParser):
    """The services' parser: help with defaults and env names (from the settings fields,
    ``meshnet_common.config.settings``), argument errors in one line and exit 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print one clear error line (no traceback) and exit non-zero."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def setup_logging(level: str, fmt: str = "logfmt") -> None:
    _setup_logging(level, fmt)
