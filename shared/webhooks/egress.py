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
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx

from shared.errors import EgressDenied
from shared.settings import Settings

log = logging.getLogger("ratchet.egress")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# What is not a public destination: every block of IANA's IPv4 and IPv6 special-purpose address
# registries (RFC 6890 and its updates, as of 2025) and the multicast ranges, written out here
# rather than read from ipaddress's is_global, whose answer changes with the interpreter's patch
# release (3.11.7 counts 192.0.0.0/24 as global). Blocks the registries mark globally reachable
# (AS112, AMT, anycast) are denied too: none is a service an agent or a webhook calls.
_DENIED_IPV4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # carrier-grade NAT (RFC 6598); Alibaba's metadata: 100.100.100.200
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local; the cloud metadata service: 169.254.169.254
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments; Oracle's metadata: 192.0.0.192
        "192.0.2.0/24",  # documentation (TEST-NET-1)
        "192.31.196.0/24",  # AS112-v4 (RFC 7535)
        "192.52.193.0/24",  # AMT (RFC 7450)
        "192.88.99.0/24",  # deprecated 6to4 relay anycast (RFC 7526)
        "192.168.0.0/16",  # private
        "192.175.48.0/24",  # AS112 direct delegation (RFC 7534)
        "198.18.0.0/15",  # benchmarking (RFC 2544)
        "198.51.100.0/24",  # documentation (TEST-NET-2)
        "203.0.113.0/24",  # documentation (TEST-NET-3)
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast 255.255.255.255
    )
)
_DENIED_IPV6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/128",  # unspecified
        "::1/128",  # loopback
        "64:ff9b:1::/48",  # NAT64 local use (RFC 8215): its IPv4 address may sit anywhere
        "100::/64",  # discard-only (RFC 6666)
        "100:0:0:1::/64",  # dummy prefix (RFC 9780)
        "2001::/23",  # IETF protocol assignments: Teredo, benchmarking, ORCHID, AMT, AS112 …
        "2001:db8::/32",  # documentation
        "2620:4f:8000::/48",  # AS112 direct delegation (RFC 7534)
        "3fff::/20",  # documentation (RFC 9637)
        "5f00::/16",  # segment routing SIDs (RFC 9602)
        "fc00::/7",  # unique local; AWS's metadata: fd00:ec2::254
        "fe80::/10",  # link-local
        "fec0::/10",  # deprecated site-local, which some stacks still route inside the site
        "ff00::/8",  # multicast
    )
)
# IPv6 prefixes whose last 32 bits are an IPv4 address that a translator or a dual-stack host
# may connect to, so the address is judged by that IPv4 address: IPv4-mapped (::ffff:0:0/96),
# IPv4-compatible (::/96), IPv4-translated (::ffff:0:0:0/96, RFC 2765) and NAT64's well-known
# prefix (64:ff9b::/96, RFC 6052). 6to4 (2002::/16) carries it in bits 16 to 48.
_EMBEDDING_IPV4 = tuple(
    ipaddress.IPv6Network(n) for n in ("::ffff:0:0/96", "::/96", "::ffff:0:0:0/96", "64:ff9b::/96")
)
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
# The IPv6 global unicast space: the rest is reserved by the IETF, and not a destination.
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
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
    if address in _SIX_TO_FOUR:
        return ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    if any(address in network for network in _EMBEDDING_IPV4):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` may be connected to without the operator's allow-list: it lies in
    no special-purpose block, an IPv6 address that embeds an IPv4 one is judged by that IPv4
    address, and any other IPv6 address must be global unicast. The same answer on every
    interpreter: nothing here asks ``ipaddress`` what is global."""
    if isinstance(address, ipaddress.IPv4Address):
        return not any(address in network for network in _DENIED_IPV4)
    if any(address in network for network in _DENIED_IPV6):
        return False
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return is_public(embedded)
    return address in _GLOBAL_UNICAST


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
    blocked = [str(a) for a in addresses if not is_public(a)]
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


def pinned_stream(
    client: httpx.Client,
    destination: Destination,
    *,
    method: str,
    headers: Mapping[str, str],
    extensions: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> AbstractContextManager[httpx.Response]:
    """As :func:`pinned_request`, with the body left unread: the caller reads as much of it as
    it wants inside ``with``, and the connection closes at its end."""
    url, sent, more = destination.url, httpx.Headers(headers), dict(extensions or {})
    if destination.address is not None:
        ip = destination.address
        url = url.copy_with(host=f"[{ip}]" if ":" in ip else ip)
        sent["Host"] = destination.url.netloc.decode()
        more["sni_hostname"] = destination.host
    return client.stream(method, url, headers=sent, extensions=more, **kwargs)
