"""Structured log lines and per-service metric registries."""

from __future__ import annotations

import asyncio
import json
import logging

from meshnet_common.logs import (
    ContextFilter,
    JsonFormatter,
    LogfmtFormatter,
    accept_request_id,
    bind_session,
    event,
    request_id_var,
)
from meshnet_common.metrics import Metrics


def _record(message: str, *args, level=logging.INFO, **fields) -> logging.LogRecord:
    record = logging.LogRecord("meshnet_test", level, __file__, 1, message, args, None)
    if fields:
        record.fields = fields
    ContextFilter().filter(record)
    return record


def test_logfmt_line_quotes_what_needs_it():
    token = request_id_var.set("req-1")
    bind_session("abc123")
    try:
        record = _record("generation %s", "done", tokens=16, finish="stop", note="two words")
    finally:
        request_id_var.reset(token)
        bind_session(None)
    line = LogfmtFormatter().format(record)
    assert line.startswith("ts=") and "Z level=info logger=meshnet_test " in line
    assert 'request_id=req-1 session_id=abc123 msg="generation done"' in line
    assert line.endswith('tokens=16 finish=stop note="two words"')
    assert "\n" not in LogfmtFormatter().format(_record("two\nlines"))


def test_json_line_and_missing_ids():
    data = json.loads(JsonFormatter().format(_record("hello", level=logging.WARNING, n=3)))
    assert data["level"] == "warning" and data["msg"] == "hello" and data["n"] == 3
    assert "request_id" not in data and "session_id" not in data


def test_event_logs_fields(caplog):
    logger = logging.getLogger("meshnet_test.event")
    with caplog.at_level(logging.INFO, logger="meshnet_test.event"):
        event(logger, logging.INFO, "thing happened", size=3)
        event(logger, logging.DEBUG, "not shown", size=4)
    [record] = caplog.records
    assert record.getMessage() == "thing happened" and record.fields == {"size": 3}


def test_context_ids_are_per_task():
    async def handler(request_id: str) -> str | None:
        request_id_var.set(request_id)
        await asyncio.sleep(0)
        return _record("x").request_id

    async def main():
        return await asyncio.gather(handler("a"), handler("b"))

    assert asyncio.run(main()) == ["a", "b"]
    assert request_id_var.get() is None


def test_ids_accepted_only_when_sane():
    assert accept_request_id("abc-DEF_1.2") == "abc-DEF_1.2"
    for bad in (None, "", "x" * 65, "has space", "new\nline", 'quo"te'):
        assert accept_request_id(bad).startswith("req-")
    bind_session("9f" * 16)
    assert _record("x").session_id == "9f" * 16
    for bad in ("x" * 129, "a b", "<script>"):
        bind_session(bad)
        assert _record("x").session_id is None


def test_registries_are_per_service_and_callbacks_read_live_values():
    first, second = Metrics(), Metrics()
    first.tokens_generated.inc(3)
    held = {"a": 2.0}
    first.watch("things", "test gauge", lambda: [({"kind": k}, v) for k, v in held.items()])
    first.watch("total_things", "test counter", lambda: 7, kind="counter")
    held["b"] = 5.0
    text = first.exposition().decode()
    assert "meshnet_tokens_generated_total 3.0" in text
    assert 'meshnet_things{kind="a"} 2.0' in text and 'meshnet_things{kind="b"} 5.0' in text
    assert "meshnet_total_things_total 7.0" in text
    assert "_created" not in text
    assert "meshnet_tokens_generated_total 0.0" in second.exposition().decode()
    assert "meshnet_things" not in second.exposition().decode()


def test_timer_observes_async_bodies():
    metrics = Metrics()

    async def step():
        with metrics.timer(metrics.hop_seconds, "http://next"):
            await asyncio.sleep(0.01)

    asyncio.run(step())
    text = metrics.exposition().decode()
    assert 'meshnet_hop_seconds_count{hop="http://next"} 1.0' in text
