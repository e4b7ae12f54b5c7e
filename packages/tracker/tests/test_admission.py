"""Which address the tracker reaches a registering node at (pure: no sockets)."""

from __future__ import annotations

import pytest

from meshnet_common.errors import InvalidRequest
from meshnet_tracker.api.admission import reachable_url


@pytest.mark.parametrize(
    ("announced", "source", "expected"),
    [
        # A wildcard bind address is replaced with the address the registration came from.
        ("http://0.0.0.0:8000", "192.0.2.7", "http://192.0.2.7:8000"),
        ("http://0.0.0.0:8000", "127.0.0.1", "http://127.0.0.1:8000"),
        ("http://[::]:8000", "2001:db8::5", "http://[2001:db8::5]:8000"),
        # Loopback is kept for a node on the tracker's host, replaced for one elsewhere.
        ("http://127.0.0.1:8000", "127.0.0.1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000", "192.0.2.7", "http://192.0.2.7:8000"),
        ("http://localhost:8000", "192.0.2.7", "http://192.0.2.7:8000"),
        # A routable bind address is kept as it is.
        ("http://192.0.2.9:8000", "192.0.2.7", "http://192.0.2.9:8000"),
        # An unknown source (in-process callers) changes nothing.
        ("http://0.0.0.0:8000", None, "http://0.0.0.0:8000"),
        ("http://0.0.0.0:8000", "testclient", "http://0.0.0.0:8000"),
    ],
)
def test_derived_url(announced, source, expected):
    assert reachable_url(announced, False, source) == expected


def test_an_explicit_url_is_used_as_given():
    assert reachable_url("http://node-b.lan:8000", True, "192.0.2.7") == "http://node-b.lan:8000"
    assert reachable_url("http://127.0.0.1:8000", True, "127.0.0.1") == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("announced", "source"),
    [("http://0.0.0.0:8000", "192.0.2.7"), ("http://127.0.0.1:8000", "192.0.2.7")],
)
def test_an_explicit_url_no_other_machine_can_dial_is_refused(announced, source):
    with pytest.raises(InvalidRequest) as err:
        reachable_url(announced, True, source)
    assert "--advertise-url" in err.value.message and err.value.code == "bad_advertise_url"
