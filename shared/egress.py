"""Outbound HTTP policy: which hosts Ratchet may call, and SSRF protection for the rest.

A host on the operator's allow-list may be anything, loopback included. Any other host must
resolve only to public addresses; the address that was checked is the one connected to, so a
DNS answer that changes between check and connect cannot smuggle in a private address.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from shared.errors import EgressDenied

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Destination:
    url: httpx.URL
    host: str
    address: str | None  # None: allow-listed, connect as usual


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    host = host.lower().strip("[]")
    return any(fnmatch.fnmatchcase(host, pattern.lower().strip("[]")) for pattern in allowed)


def _is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _is_public(address.ipv4_mapped)
    if isinstance(address, ipaddress.IPv6Address) and address.sixtofour is not None:
        return _is_public(address.sixtofour)
    return address.is_global and not address.is_multicast


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise EgressDenied(f"cannot resolve {host!r}") from exc
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def check_url(
    url: str, *, allowed_hosts: Iterable[str], only_allowed: bool = False, https_only: bool = False
) -> Destination:
    """Vet ``url`` against the policy and return where to connect.

    ``only_allowed``: refuse every host not on the allow-list. ``https_only``: plain http
    is allowed for allow-listed hosts only.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise EgressDenied(f"not a valid URL: {url!r}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise EgressDenied("only http and https URLs with a host are allowed")
    allowed = list(allowed_hosts)
    if host_allowed(parsed.host, allowed):
        return Destination(url=parsed, host=parsed.host, address=None)
    if only_allowed:
        raise EgressDenied(f"host {parsed.host!r} is not on the egress allow-list")
    if https_only and parsed.scheme != "https":
        raise EgressDenied("only https URLs are allowed")
    addresses = _resolve(parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80))
    blocked = [str(a) for a in addresses if not _is_public(a)]
    if not addresses or blocked:
        raise EgressDenied(
            f"host {parsed.host!r} resolves to a non-public address ({', '.join(blocked)})"
        )
    return Destination(url=parsed, host=parsed.host, address=str(addresses[0]))


def pinned_request(
    client: httpx.Client, destination: Destination, *, method: str, **kwargs: object
) -> httpx.Response:
    """Send the request to the vetted address, keeping the Host header and TLS server name."""
    if destination.address is None:
        return client.request(method, destination.url, **kwargs)  # type: ignore[arg-type]
    ip = destination.address
    url = destination.url.copy_with(host=f"[{ip}]" if ":" in ip else ip)
    headers = httpx.Headers(kwargs.pop("headers", None))  # type: ignore[arg-type]
    headers["Host"] = destination.url.netloc.decode()
    extensions = {"sni_hostname": destination.host}
    return client.request(method, url, headers=headers, extensions=extensions, **kwargs)  # type: ignore[arg-type]
