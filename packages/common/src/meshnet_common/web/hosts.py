"""What a URL's host says about where it is: an IP address, a loopback address."""

from __future__ import annotations

import ipaddress
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
