"""Structured, leveled logs: one line per event, with the request and session it belongs to.

Lines are logfmt by default (``key=value``, values with spaces quoted) or JSON
(``--log-format json``)::

    ts=2026-12-01T10:00:00.123Z level=info logger=meshnet_node.head.routes
        request_id=req-1a2b3c4d5e6f session_id=9f8e... msg="generation done" tokens=16 ...

The request id comes from the HTTP layer (``x-request-id``, kept when a caller sends a sane
one, else generated) and the session id from the generation or the forward step being
served; both live in context variables, so every line logged while handling that request
carries them without passing them around. Extra fields of an event go in
``extra={"fields": {...}}`` (see ``event``). Secrets are never logged; prompt and completion
text only at debug level.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshnet_request_id", default=None
)
session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshnet_session_id", default=None
)

H_REQUEST_ID = "x-request-id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # protocol.validate_session_id's rule
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("logfmt", "json")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def accept_request_id(offered: str | None) -> str:
    """The caller's request id when it is a short printable token, else a new one."""
    if offered and _REQUEST_ID.match(offered):
        return offered
    return new_request_id()


def bind_session(session_id: str | None) -> None:
    """Tag the rest of this task's log lines with ``session_id`` (if it is a sane token:
    a header from the network is never echoed into logs as is)."""
    ok = session_id is not None and _SESSION_ID.match(session_id) is not None
    session_id_var.set(session_id if ok else None)


def event(logger: logging.Logger, level: int, message: str, **fields) -> None:
    """Log one event with structured fields (rendered as ``key=value`` or JSON keys)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"fields": fields}, stacklevel=2)


class ContextFilter(logging.Filter):
    """Stamps each record with the current request and session ids (at logging time)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        if not hasattr(record, "session_id"):
            record.session_id = session_id_var.get()
        return True


def _logfmt_value(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


def _timestamp(record: logging.LogRecord) -> str:
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{base}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict:
    out: dict = {
        "ts": _timestamp(record),
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    for key in ("request_id", "session_id"):
        value = getattr(record, key, None)
        if value:
            out[key] = value
    out["msg"] = record.getMessage()
    extra = getattr(record, "fields", None)
    if isinstance(extra, dict):
        for key, value in extra.items():
            out.setdefault(key, value)
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


class LogfmtFormatter(logging.Formatter):
    """``key=value`` pairs on one line; a traceback, if any, is one quoted value."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    """Configure the root logger of a meshnet process (stderr, one line per event)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # library warnings become one log line each, too
    # Per-request lines of the HTTP client and server duplicate our own events.
    quiet = max(logging.WARNING, root.level)
    for name in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(name).setLevel(quiet)
