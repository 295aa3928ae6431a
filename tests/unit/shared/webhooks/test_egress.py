"""The SSRF guard: private, loopback, link-local and disguised addresses are refused."""

from __future__ import annotations

import ipaddress

import pytest

from shared.errors import EgressDenied
from shared.settings import Settings
from shared.webhooks.egress import check_url, host_allowed, is_public, warn_if_open


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/",
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/",
        "http://192.168.1.1/",
        "http://172.16.0.1/",
        "http://100.64.0.1/",
        "http://[::1]/",
        "http://[fd00::1]/",
        "http://[fe80::1]/",
        "http://2130706433/",
        "http://0x7f000001/",
        "http://017700000001/",
        "http://[::ffff:127.0.0.1]/",
        "http://0.0.0.0/",
        "http://localhost/",
        "ftp://example.com/",
        "not a url",
    ],
)
def test_private_and_disguised_addresses_are_refused(url: str) -> None:
    with pytest.raises(EgressDenied):
        check_url(url, allowed_hosts=[])


def test_allow_listed_hosts_pass_even_when_private() -> None:
    destination = check_url("http://127.0.0.1:8080/x", allowed_hosts=["127.0.0.1"])
    assert destination.address is None
    assert host_allowed("api.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil.net", ["*.example.com"])


def test_only_allowed_mode_refuses_everything_else() -> None:
    with pytest.raises(EgressDenied, match="allow-list"):
        check_url("https://93.184.215.14/", allowed_hosts=["api.example.com"], only_allowed=True)


def test_https_only_refuses_plain_http_for_unlisted_hosts() -> None:
    with pytest.raises(EgressDenied, match="https"):
        check_url("http://93.184.215.14/", allowed_hosts=[], https_only=True)


def test_public_addresses_are_pinned() -> None:
    destination = check_url("https://93.184.215.14/path", allowed_hosts=[], https_only=True)
    assert destination.address == "93.184.215.14"


@pytest.mark.parametrize(
    "address",
    [
        "::7f00:1",  # IPv4-compatible 127.0.0.1
        "::a9fe:a9fe",  # IPv4-compatible 169.254.169.254
        "::ffff:0:7f00:1",  # IPv4-translated 127.0.0.1
        "::ffff:0:a00:1",  # IPv4-translated 10.0.0.1
        "64:ff9b::7f00:1",  # NAT64 well-known prefix, 127.0.0.1
        "64:ff9b::a9fe:a9fe",  # NAT64 well-known prefix, 169.254.169.254
        "64:ff9b:1::1",  # NAT64 local-use prefix
        "64:ff9b:1:ffff::808:808",  # ... whatever it embeds
        "fec0::1",  # deprecated site-local
        "feff::1",
    ],
)
def test_ipv6_forms_embedding_private_ipv4_are_refused(address: str) -> None:
    with pytest.raises(EgressDenied, match="non-public"):
        check_url(f"http://[{address}]/", allowed_hosts=[])


@pytest.mark.parametrize("address", ["::808:808", "::ffff:0:808:808", "64:ff9b::808:808"])
def test_ipv6_forms_embedding_public_ipv4_pass(address: str) -> None:
    destination = check_url(f"http://[{address}]/", allowed_hosts=[])
    assert destination.address == address


def test_an_allow_list_matching_every_host_warns_once_that_the_policy_is_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ratchet.egress"):
        warn_if_open(Settings(http_allowed_hosts=["api.example.com"], webhook_allowed_hosts=[]))
        assert not caplog.records
        warn_if_open(Settings(http_allowed_hosts=["*"], webhook_allowed_hosts=["127.0.0.1", "*"]))
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "egress policy is off" in message
    assert "RATCHET_HTTP_ALLOWED_HOSTS and RATCHET_WEBHOOK_ALLOWED_HOSTS" in message


# IANA's IPv4 and IPv6 special-purpose address registries and the multicast ranges, written out
# again here so that the policy is checked against the registries, not against itself.
SPECIAL_PURPOSE_BLOCKS = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.31.196.0/24",
    "192.52.193.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "192.175.48.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "255.255.255.255/32",
    "::/128",
    "::1/128",
    "64:ff9b:1::/48",
    "100::/64",
    "100:0:0:1::/64",
    "2001::/23",
    "2001:db8::/32",
    "2620:4f:8000::/48",
    "3fff::/20",
    "5f00::/16",
    "fc00::/7",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
]
# Metadata services and other addresses known from SSRF reports, and IPv6 forms that carry a
# special-purpose IPv4 address: IPv4-mapped, IPv4-translated, NAT64 and 6to4.
KNOWN_TARGETS = [
    "192.0.0.192",  # Oracle Cloud metadata
    "100.100.100.200",  # Alibaba Cloud metadata
    "169.254.169.254",
    "fd00:ec2::254",  # AWS metadata over IPv6
    "::ffff:169.254.169.254",
    "::ffff:192.0.0.192",
    "::ffff:0:c000:c0",
    "64:ff9b::c000:c0",
    "64:ff9b::a9fe:a9fe",
    "2002:c000:c0::1",
    "2002:a9fe:a9fe::1",
    "2002:7f00:1::",
    "2001:0:4136:e378::1",  # Teredo
]
PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "192.0.1.1",
    "100.63.255.255",
    "100.128.0.0",
    "172.15.255.255",
    "172.32.0.0",
    "198.17.255.255",
    "198.20.0.0",
    "223.255.255.255",
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
]


def _url(address: ipaddress.IPv4Address | ipaddress.IPv6Address | str) -> str:
    address = ipaddress.ip_address(address)
    return f"http://[{address}]/" if address.version == 6 else f"http://{address}/"


@pytest.fixture(params=["as-is", "all-global", "none-global"])
def interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's answers whatever this interpreter's ``ipaddress`` thinks is global."""
    if request.param == "as-is":
        return
    answer = request.param == "all-global"
    for kind in (ipaddress.IPv4Address, ipaddress.IPv6Address):
        monkeypatch.setattr(kind, "is_global", property(lambda self: answer))
        monkeypatch.setattr(kind, "is_private", property(lambda self: not answer))


@pytest.mark.parametrize("block", SPECIAL_PURPOSE_BLOCKS)
def test_every_special_purpose_block_is_refused(block: str, interpreter: None) -> None:
    network = ipaddress.ip_network(block)
    for address in (network[0], network[network.num_addresses // 2], network[-1]):
        assert not is_public(address), address
        with pytest.raises(EgressDenied, match="non-public"):
            check_url(_url(address), allowed_hosts=[])


@pytest.mark.parametrize("address", KNOWN_TARGETS)
def test_metadata_services_and_disguised_forms_are_refused(address: str, interpreter: None) -> None:
    assert not is_public(ipaddress.ip_address(address))
    with pytest.raises(EgressDenied, match="non-public"):
        check_url(_url(address), allowed_hosts=[])


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass_on_any_interpreter(address: str, interpreter: None) -> None:
    assert is_public(ipaddress.ip_address(address))
    pinned = check_url(_url(address), allowed_hosts=[]).address
    assert pinned is not None
    assert ipaddress.ip_address(pinned) == ipaddress.ip_address(address)


@pytest.mark.parametrize("address", ["192.0.0.192", "100.100.100.200", "fd00:ec2::254"])
def test_the_operator_may_still_allow_list_a_special_purpose_address(address: str) -> None:
    destination = check_url(_url(address), allowed_hosts=[address])
    assert destination.address is None  # connected to as named: the operator's choice
