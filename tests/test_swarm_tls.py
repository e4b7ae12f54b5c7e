"""TLS end to end (docs/adr/0025): a tracker node and a node serving https and wss, each
verifying the other against a throwaway CA made here; clients too. Plain HTTP and clients
without the CA are refused."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import pytest
import trustme
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration]

FP32 = ("--quantization", "float32")


@pytest.fixture
def pki(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.private_key_pem.write_to_path(paths["key"])
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(paths["cert"], append=i > 0)
    return paths


def tls_flags(pki) -> tuple[str, ...]:
    return ("--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
            "--tls-ca", str(pki["ca"]))  # fmt: skip


def test_a_swarm_over_tls_answers_and_refuses_plain_http(models_dir, tiny_snapshot, tiny_model_id,
                                                          tmp_path, pki):  # fmt: skip
    tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    ca = ssl.create_default_context(cafile=str(pki["ca"]))  # what clients verify with
    try:
        tracker = swarm.tracker("--model-id", model_id, "--shard-start", "0", "--shard-end", "3",
                                *FP32, *tls_flags(pki))  # fmt: skip
        tracker.scheme, tracker.verify = "https", ca
        tracker.wait_healthy()
        node = swarm.node(tracker, model_id, 3, 6, *FP32, *tls_flags(pki))
        node.scheme, node.verify = "https", ca
        node.wait_healthy()
        wait_for(lambda: covered(tracker, model_id, verify=ca), timeout=60)
        coverage = httpx.get(f"{tracker.url}/v1/coverage", verify=ca, timeout=5).json()
        urls = {n["url"] for m in coverage["models"] for n in m["nodes"]}
        assert urls and all(u.startswith("https://") for u in urls), urls
        body = {"model": model_id, "prompt": "hello", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        # The tracker node's head sends its steps over wss to the node and back.
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, verify=ca, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 12
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
            httpx.get(f"http://127.0.0.1:{node.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{node.url}/health", timeout=5)  # the system's CAs do not know ours
    finally:
        swarm.close()


def test_a_certificate_without_its_key_is_one_line(tmp_path, pki):
    out = subprocess.run(
        [sys.executable, "-m", "meshnet_node.cli", "--tracker", "https://127.0.0.1:1",
         "--tls-cert", str(pki["cert"])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tls-cert and --tls-key go together" in lines[0], out.stderr
