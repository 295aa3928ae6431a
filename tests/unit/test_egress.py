"""The SSRF guard: private, loopback, link-local and disguised addresses are refused."""

from __future__ import annotations

import pytest

from shared.egress import check_url, host_allowed
from shared.errors import EgressDenied


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
