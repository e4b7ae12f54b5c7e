"""What a URL's host says about where it is (an IP address, a loopback address), which
Host names a server answers to, and which machine a registering node stands on."""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The host as an IP address (brackets of an IPv6 URL host allowed); None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str | None) -> bool:
    """``localhost`` or a loopback address: only this machine answers there."""
    if host in ("localhost",):
        return True
    ip = ip_of(host or "")
    return ip is not None and ip.is_loopback


def url_is_loopback(url: str) -> bool:
    """The URL's host is this machine's loopback (see :func:`is_loopback`)."""
    try:
        return is_loopback(urlsplit(url).hostname)
    except ValueError:
        return False


def require_https(url: str | None, what: str, *, tls: bool = True) -> None:
    """ValueError naming ``what`` when ``url`` is not https and ``tls`` is on: a process
    serving TLS (``--tls-cert``) dials no plain-HTTP peer (docs/adr/0032)."""
    if tls and url and urlsplit(url).scheme != "https":
        raise ValueError(
            f"{what} {url} is plain http://, but this process serves TLS (--tls-cert): "
            "give the peer's https:// URL"
        )


def server_url(scope) -> str:
    """This server's URL as the caller reached it: the scheme and the local address of the
    connection's own socket (uvicorn's ``scope["server"]``), never the client's ``Host``
    header, which a client can set to anything (docs/adr/0032)."""
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    host, port = scope.get("server") or ("127.0.0.1", None)
    ip = ip_of(host)
    netloc = f"[{ip}]" if ip is not None and ip.version == 6 else host
    return f"{scheme}://{netloc}" if port is None else f"{scheme}://{netloc}:{port}"


# -- the Host allow-list (DNS rebinding, docs/adr/0032) ----------------------------------------

LOOPBACK_NAMES = frozenset({"localhost"})


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port, lower case, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):  # [v6]:port
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.rsplit(":", 1)[0]
    return header.rstrip(".")


def host_allowed(header: str | None, names: frozenset[str]) -> bool:
    """Whether a request whose ``Host`` header is ``header`` is for this server: a loopback
    name, any IP address (a page a rebinding attack serves is on a name the attacker owns;
    an address is dialed as such), or one of ``names`` (``*``: any)."""
    if header is None or "*" in names:
        return True  # HTTP/1.0 without Host: no browser page sends that
    name = host_name(header)
    return name in LOOPBACK_NAMES or ip_of(name) is not None or name in names


def served_names(
    allowed: tuple[str, ...], *urls: str | None, hosts: tuple[str, ...] = ()
) -> frozenset[str]:
    """The names a server answers to: ``allowed`` (--allowed-host), the hosts of its
    advertised ``urls`` and its bound ``hosts`` that are names (a wildcard is none)."""
    names = {n.lower().rstrip(".") for n in allowed}
    for url in urls:
        try:
            host = urlsplit(url).hostname if url else None
        except ValueError:
            host = None
        if host:
            names.add(host.rstrip("."))
    names.update(h.lower().rstrip(".") for h in hosts if h and ip_of(h) is None)
    return frozenset(names)


_HOST = b"host"
_MISDIRECTED = json.dumps({"error": {
    "message": "this server does not answer to that Host name (add it with --allowed-host)",
    "type": "invalid_request_error", "param": "host", "code": "host_not_allowed",
}}).encode()  # fmt: skip


class HostGate:
    """Pure ASGI: a request (or WebSocket) naming another server in its ``Host`` header is
    answered 421 before anything reads it: a browser page whose name was rebound to this
    machine's address cannot reach a loopback service (docs/adr/0032)."""

    def __init__(self, app, names: frozenset[str]) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = next((v for k, v in scope["headers"] if k == _HOST), None)
            # The server's own name for itself (uvicorn: its socket's address; an in-process
            # ASGI transport: the URL's host) is one of its names.
            names = self.names | {str((scope.get("server") or ("",))[0]).lower()}
            if not host_allowed(None if header is None else header.decode("latin-1"), names):
                await _refuse(scope, send)
                return
        await self.app(scope, receive, send)


async def _refuse(scope, send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 421, "headers": headers})
    await send({"type": "http.response.body", "body": _MISDIRECTED})


# -- which machine a node stands on (docs/adr/0032: admission bounds, witnesses) --------------


def source_of(peer: str | None) -> str | None:
    """The source a registration is counted under (``--max-nodes-per-source``): the peer's
    address, an IPv6 one as its /64 (one machine holds many)."""
    ip = ip_of(peer or "")
    if ip is None or ip.version == 4:
        return peer
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def machine_names(url: str, source: str | None) -> frozenset[str]:
    """Names of the machine a node runs on: its URL's host (lower case) and its source
    (``source_of``), where that is an address (an in-process caller's is not): witnesses
    stand on machines that share neither. A node registering from the tracker's own machine
    at a loopback URL is the operator's process (no member reaches the tracker from
    loopback, nor is called back there): its URL's host and port name it, so that a swarm on
    one machine still has witnesses."""
    parts = urlsplit(url)
    if source is not None and is_loopback(source) and is_loopback(parts.hostname):
        return frozenset({parts.netloc.lower()})
    names = {(parts.hostname or "").lower()}
    if source is not None and (ip_of(source) is not None or "/" in source):
        names.add(source)
    return frozenset(names)
