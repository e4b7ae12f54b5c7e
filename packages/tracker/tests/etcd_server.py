"""A real etcd for tests: started from the ``etcd`` binary (Debian's etcd-server) on free
127.0.0.1 ports in a temporary folder, stopped after; without the binary, the tests that
need one skip with one line. Fixture: ``etcd``, one server per test module (import ``etcd_fixture``)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trustme

SKIP = "etcd is not installed (apt install etcd-server): tests against a real etcd skipped"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_pki(folder: Path) -> dict[str, Path]:
    """A throwaway CA, etcd's server certificate for 127.0.0.1 and a client certificate
    (a tracker's), as PEM files: ca, server_cert, server_key, client_cert, client_key."""
    ca = trustme.CA()
    paths = {"ca": folder / "ca.pem"}
    ca.cert_pem.write_to_path(paths["ca"])
    for name, cert in (
        ("server", ca.issue_cert("127.0.0.1")),
        ("client", ca.issue_cert("tracker")),
    ):
        paths[f"{name}_cert"], paths[f"{name}_key"] = folder / f"{name}.pem", folder / f"{name}.key"
        cert.private_key_pem.write_to_path(paths[f"{name}_key"])
        for i, pem in enumerate(cert.cert_chain_pems):
            pem.write_to_path(paths[f"{name}_cert"], append=i > 0)
    return paths


class EtcdServer:
    """One etcd member on loopback; ``url`` is its client endpoint. With ``pki`` (see
    ``make_pki``) it serves https and admits only clients with a certificate of that CA."""

    def __init__(self, data_dir: Path, pki: dict[str, Path] | None = None):
        client, peer = free_port(), free_port()
        self.pki = pki
        self.url = f"{'https' if pki else 'http'}://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.log_path = data_dir / "etcd.log"
        command = [
            shutil.which("etcd") or "etcd",
            "--name", "default",
            "--data-dir", str(data_dir / "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}",
        ]  # fmt: skip
        if pki is not None:
            command += ["--cert-file", str(pki["server_cert"]), "--key-file", str(pki["server_key"]),
                        "--trusted-ca-file", str(pki["ca"]), "--client-cert-auth"]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, attempts: int = 200) -> EtcdServer:
        """Until it answers a read (every 50 ms; fails with its log after ``attempts``)."""
        verify: ssl.SSLContext | bool = True
        if self.pki is not None:
            verify = ssl.create_default_context(cafile=str(self.pki["ca"]))
            verify.load_cert_chain(str(self.pki["client_cert"]), str(self.pki["client_key"]))
        for _ in range(attempts):
            if self.popen.poll() is not None:
                break
            try:
                answer = httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, verify=verify)
                if answer.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not start:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_etcd(data_dir: Path, pki: dict[str, Path] | None = None) -> EtcdServer:
    """A running etcd in ``data_dir``, or the test skips when the binary is missing."""
    if shutil.which("etcd") is None:
        pytest.skip(SKIP)
    return EtcdServer(data_dir, pki).wait_ready()


@pytest.fixture(scope="module", name="etcd")
def etcd_fixture(tmp_path_factory):
    """A running etcd for the module's tests (import ``etcd_fixture``; request ``etcd``)."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()
