"""The knobs of a process listening for HTTP (meshnet-node, the tracker): which Host names it
answers to, how many connections one address may hold, how long a request body may take.
A base of ``ShardSettings``, so that both services offer them (docs/adr/0032)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import field_validator
from pydantic_settings import NoDecode

from meshnet_common.config import defaults
from meshnet_common.config.settings import ServiceSettings, knob

SECURITY = "security"  # the help group of shard.py's SECURITY


class ListenSettings(ServiceSettings):
    """What a listening process accepts from the connections it is sent."""

    allowed_hosts: Annotated[tuple[str, ...], NoDecode] = knob(
        (), "host names this process answers to in a request's Host header, besides loopback "
        "names (localhost), IP addresses, its --host and its --advertise-url's host; any other "
        "name is answered 421 (DNS rebinding); *: any (repeatable; env: comma-separated)",
        group=SECURITY, flag="--allowed-host", action="append",
    )  # fmt: skip
    max_connections_per_address: int = knob(
        defaults.CONNECTIONS_PER_ADDRESS, "connections one client address may hold open at "
        "once (beyond: 503 and closed; 0: no cap below the process's 1024)", group=SECURITY,
    )  # fmt: skip
    body_timeout_s: float = knob(
        defaults.BODY_TIMEOUT_S, "seconds a request body may take to arrive, counted from "
        "its request's start (beyond: 408)", group=SECURITY, flag="--body-timeout",
    )  # fmt: skip

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, value):
        names = value.split(",") if isinstance(value, str) else value
        names = tuple(n.strip().lower().rstrip(".") for n in names if n.strip())
        bad = [n for n in names if n != "*" and not re.fullmatch(r"[a-z0-9_.-]{1,253}", n)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a host name (no scheme, port or path), or *")
        return names

    @field_validator("max_connections_per_address")
    @classmethod
    def _cap(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be 0 (no cap) or more")
        return value

    @field_validator("body_timeout_s")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("must be more than 0 seconds")
        return value
