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
