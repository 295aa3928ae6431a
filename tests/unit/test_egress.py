"""The SSRF guard: private, loopback, link-local and disguised addresses are refused."""

from __future__ import annotations

import pytest

from shared.errors import EgressDenied
from shared.settings import Settings
from shared.webhooks.egress import check_url, host_allowed, warn_if_open


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
