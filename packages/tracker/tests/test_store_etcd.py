"""What only the etcd store does: ``--store`` URLs, etcd's refusals as StoreError, failing
over between endpoints (requests and watches), and leader election over a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from contextlib import aclosing

import httpx
import pytest
from etcd_server import etcd_fixture, free_port, make_pki, start_etcd  # noqa: F401  (the fixture "etcd")

from meshnet_tracker.store import (
    Election,
    EtcdStore,
    MemoryStore,
    StoreError,
    open_store,
    parse_store_url,
)


def test_store_urls_name_every_member_and_bad_ones_are_one_line():
    assert parse_store_url("etcd://10.0.0.1:2379") == ["http://10.0.0.1:2379"]
    assert parse_store_url("etcd://a:1, b:2,[::1]:3") == [
        "http://a:1",
        "http://b:2",
        "http://[::1]:3",
    ]
    for bad in ("http://a:1", "etcd://", "etcd://a", "etcd://a:x", "etcd://a:1,", "etcd://u@a:1",
                "etcd://a:1/path", "etcd://a:99999"):  # fmt: skip
        with pytest.raises(ValueError, match="--store") as caught:
            parse_store_url(bad)
        assert "\n" not in str(caught.value)
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store("memory"), MemoryStore)
    assert open_store("etcd://a:1,b:2").urls == ["http://a:1", "http://b:2"]


def test_etcds_refusals_are_store_errors(etcd):
    async def main():
        async with EtcdStore([etcd.url]) as store:
            with pytest.raises(StoreError, match="lease not found"):
                await store.put("refused/k", b"v", lease=12345)
            with pytest.raises(StoreError, match="lease not found"):
                await store.create("refused/k", b"v", lease=12345)
            await store.revoke(12345)  # gone already: no error
            assert await store.keepalive(12345) is False
            with pytest.raises(StoreError, match="positive TTL"):
                await store.grant(0)
            assert await store.get("refused/k") is None

    asyncio.run(main())


def test_requests_fail_over_to_the_endpoint_that_answers(etcd):
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with EtcdStore([dead, etcd.url], timeout_s=2) as store:
            await store.put("failover/k", b"v")
            assert await store.get("failover/k") == b"v"
            assert store.endpoints()[0] == etcd.url  # the next call starts where one answered
        async with EtcdStore([dead, f"http://127.0.0.1:{free_port()}"]) as store:
            with pytest.raises(StoreError, match="no etcd endpoint answered") as caught:
                await store.get("failover/k")
            assert dead in str(caught.value) and "\n" not in str(caught.value)

    asyncio.run(main())


class Proxy:
    """A TCP relay to etcd that a test can cut, as if that endpoint's machine died."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.writers: list[asyncio.StreamWriter] = []
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def relay(self, reader, writer) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(source, sink):
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(
            pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
        )

    def cut(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()


def test_a_watch_resumes_on_another_endpoint_without_missing_or_repeating(etcd):
    async def main():
        proxy = Proxy(int(etcd.url.rsplit(":", 1)[1]))
        async with EtcdStore([await proxy.start(), etcd.url]) as store:
            start = await store.put("resume/0", b"0")
            async with aclosing(store.watch("resume/", start_revision=start)) as watch:
                first = await asyncio.wait_for(anext(watch), 5)
                assert proxy.connections >= 1  # the watch went through the relay
                proxy.cut()
                for n in (1, 2):
                    await store.put(f"resume/{n}", str(n).encode())
                rest = [await asyncio.wait_for(anext(watch), 5) for _ in range(2)]
        assert [e.key for e in [first, *rest]] == ["resume/0", "resume/1", "resume/2"]

    asyncio.run(main())


def test_a_watch_from_a_compacted_revision_is_a_store_error(etcd):
    async def main():
        async with EtcdStore([etcd.url]) as store:
            first = await store.put("compacted/k", b"1")
            last = await store.put("compacted/k", b"2")
            httpx.post(f"{etcd.url}/v3/kv/compaction", json={"revision": str(last)})
            with pytest.raises(StoreError, match="compacted"):
                await asyncio.wait_for(anext(store.watch("compacted/", start_revision=first)), 5)
            assert await store.get("compacted/k") == b"2"

    asyncio.run(main())


def test_closing_the_store_ends_its_watches(etcd):
    async def main():
        store = EtcdStore([etcd.url])
        watch = store.watch("closing/")
        waiting = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.1)
        await store.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(StoreError, match="closed"):
            await store.get("closing/k")

    asyncio.run(main())


def test_election_over_etcd_takeover_after_the_leaders_lease_and_resign_hands_back(etcd):
    """Two trackers' candidates over one etcd (TTL 2 s, etcd's least): the second takes
    over once the first stops renewing, never while the first still believes it leads."""

    async def main():
        stores = [EtcdStore([etcd.url]), EtcdStore([etcd.url])]
        first, second = (
            Election(s, "election", name, 2.0) for s, name in zip(stores, "ab", strict=True)
        )
        try:
            assert await first.step() is True
            assert await second.step() is False
            assert await second.leader() == "a"
            steps = 0
            while not await second.step():  # the first is gone: it steps no more
                assert not (first.is_leader and second.is_leader)
                steps += 1
                assert steps < 60, "the second candidate never took over"
                await asyncio.sleep(0.1)
            assert not first.is_leader and await first.leader() == "b"
            assert steps >= 5  # not before the lease ran out (2 s at 0.1 s a step)
            await second.resign()
            assert await first.step() is True  # at once: the key went with the lease
            assert await second.step() is False
        finally:
            for store in stores:
                await store.close()

    asyncio.run(main())


def test_an_etcds_store_speaks_tls_and_etcd_admits_only_certified_clients(tmp_path):
    """etcd with --client-cert-auth: the tracker's store with the CA and its client
    certificate works; without the certificate, or trusting another CA, it is refused."""
    pki = make_pki(tmp_path)
    server = start_etcd(tmp_path, pki)
    spec = "etcds://" + server.url.removeprefix("https://")
    (tmp_path / "other").mkdir()
    other_ca = make_pki(tmp_path / "other")["ca"]

    async def main():
        ca, cert, key = pki["ca"], pki["client_cert"], pki["client_key"]
        async with open_store(spec, ca=ca, cert=cert, key=key) as store:
            await store.put("tls/k", b"v")
            assert await store.get("tls/k") == b"v"
        async with open_store(spec, ca=ca) as store:  # no client certificate
            with pytest.raises(StoreError):
                await store.get("tls/k")
        async with open_store(spec, ca=other_ca, cert=cert, key=key) as store:
            with pytest.raises(StoreError, match="no etcd endpoint answered"):
                await store.get("tls/k")

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_refused_client_certificate_is_an_endpoint_that_did_not_answer(tmp_path):
    """Under TLS 1.3 a server refuses a client's certificate after the handshake; the alert
    reaches the client on its first read, sometimes as a bare ssl.SSLError that httpx does
    not wrap. Either way the store names the endpoint and raises a StoreError."""
    pki = make_pki(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki["ca"])
    context.load_cert_chain(pki["server_cert"], pki["server_key"])
    context.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def refuse_every_client():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            with contextlib.suppress(ssl.SSLError, OSError):
                context.wrap_socket(conn, server_side=True).close()
            conn.close()

    threading.Thread(target=refuse_every_client, daemon=True).start()

    async def main():
        async with open_store(f"etcds://127.0.0.1:{port}", ca=pki["ca"]) as store:
            for _ in range(8):  # which error surfaces depends on timing: try it often
                with pytest.raises(StoreError, match=f"no etcd endpoint answered.*{port}"):
                    await store.get("k")

    try:
        asyncio.run(main())
    finally:
        listener.close()


def test_tls_files_go_with_etcds_only_and_must_load(tmp_path):
    with pytest.raises(ValueError, match="use etcds://"):
        open_store("etcd://a:1", ca=tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="both or neither"):
        open_store("etcds://a:1", cert=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="TLS files") as caught:
        open_store("etcds://a:1", ca=tmp_path / "missing.pem")
    assert "\n" not in str(caught.value)
    assert open_store("etcds://a:1").urls == ["https://a:1"]
