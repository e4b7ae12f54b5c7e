"""Bounded resources over real processes (issue #35, docs/adr/0032): a running tracker's
registration call-back answers a closed port and an open one alike and sends the open one
no swarm token; a node serving TLS refuses a plain-HTTP tracker in one line."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import trustme
from answering_port import AnsweringPort, http_reply
from swarm_harness import closed_port

pytestmark = [pytest.mark.integration]

TOKEN = {"x-meshnet-swarm-token": "swarm-1"}


def announcement(url: str) -> dict:
    return {
        "node_id": "probe", "url": url, "url_explicit": True,
        "shard": {"model_id": "org/m", "shard_start": 0, "shard_end": 4}, "num_layers": 4,
        "quantization": "float32", "device": "cpu", "memory_declared_bytes": 1 << 30,
        "memory_free_bytes": 1 << 29,
    }  # fmt: skip


def test_a_running_trackers_probe_of_closed_and_open_ports_answers_alike(swarm_factory):
    tracker = swarm_factory().tracker("--swarm-token", "swarm-1").wait_healthy()
    garbage = http_reply(b"<html>" + b"x" * (1 << 20) + b"</html>")
    with AnsweringPort(garbage) as server:
        urls = {"closed": f"http://127.0.0.1:{closed_port()}", "open": server.url}
        answers = {}
        for kind, url in urls.items():
            resp = httpx.post(f"{tracker.url}/v1/nodes/register", json=announcement(url),
                              headers=TOKEN, timeout=30)  # fmt: skip
            answers[kind] = (resp.status_code, resp.text.replace(url, "URL"))
        assert answers["closed"] == answers["open"], answers
        assert answers["closed"][0] == 400 and "node_unreachable" in answers["closed"][1]
        assert server.requests
        assert all("x-meshnet-swarm-token" not in h for h in server.requests)


def test_a_tls_node_refuses_a_plain_http_tracker(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(cert_path)
    cert.private_key_pem.write_to_path(key_path)
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_node.cli", "--tracker",
         "https://127.0.0.1:8,http://127.0.0.1:9",  # each tracker of the list is checked
         "--tls-cert", str(cert_path), "--tls-key", str(key_path), "--memory-gb", "1",
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--tracker http://127.0.0.1:9 is plain http://" in done.stderr, done.stderr
