"""Outbound HTTP policy: which hosts Ratchet may call, and SSRF protection for the rest.

A host on the operator's allow-list may be anything, loopback included. Any other host must
resolve only to public addresses; the address that was checked is the one connected to, so a
DNS answer that changes between check and connect cannot smuggle in a private address.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

import httpx

from shared.errors import EgressDenied
from shared.settings import Settings

log = logging.getLogger("ratchet.egress")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes whose last 32 bits are an IPv4 address that a translator or a dual-stack host
# may connect to: IPv4-compatible (::/96), IPv4-translated (::ffff:0:0:0/96, RFC 2765) and
# NAT64's well-known prefix (64:ff9b::/96, RFC 6052). IPv4-mapped and 6to4 have their own
# accessors in ipaddress.
_EMBEDDING_IPV4 = tuple(
    ipaddress.IPv6Network(n) for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96")
)
# Never public, whatever they embed: NAT64's local-use prefix (RFC 8215), where the IPv4
# address may sit anywhere after the prefix, and the deprecated site-local fec0::/10, which
# some stacks still route inside the site.
_NEVER_PUBLIC = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b:1::/48", "fec0::/10"))
# Hosts that only an allow-list matching everything lets through.
_PROBE_HOSTS = ("127.0.0.1", "169.254.169.254", "10.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True)
class Destination:
    url: httpx.URL
    host: str
    address: str | None  # None: allow-listed, connect as usual


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    host = host.lower().strip("[]")
    return any(fnmatch.fnmatchcase(host, pattern.lower().strip("[]")) for pattern in allowed)


def allows_everything(allowed: Iterable[str]) -> bool:
    """True when the allow-list lets loopback, private and metadata hosts through (``*``)."""
    allowed = list(allowed)
    return all(host_allowed(host, allowed) for host in _PROBE_HOSTS)


def warn_if_open(settings: Settings) -> None:
    """Log one warning at start when an allow-list turns the SSRF policy off."""
    open_lists = tuple(
        name
        for name, allowed in (
            ("RATCHET_HTTP_ALLOWED_HOSTS", settings.http_allowed_hosts),
            ("RATCHET_WEBHOOK_ALLOWED_HOSTS", settings.webhook_allowed_hosts),
        )
        if allows_everything(allowed)
    )
    if open_lists:
        _warn_open(open_lists)


@cache  # once per process: `ratchet dev` starts the API and a worker in one
def _warn_open(open_lists: tuple[str, ...]) -> None:
    log.warning(
        "the egress policy is off: %s allows every host, loopback, private and cloud "
        "metadata addresses included",
        " and ".join(open_lists),
    )


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in network for network in _EMBEDDING_IPV4):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)  # :: and ::1 give 0.0.0.x
    return None


def _is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        if any(address in network for network in _NEVER_PUBLIC):
            return False
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return _is_public(embedded)
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
