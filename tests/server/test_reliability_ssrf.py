"""The image-URL guard against IPv6 forms that carry an IPv4 address (issue 16.6): each reaches the IPv4 address
it embeds, so a request could reach the metadata endpoint or loopback through them. They are refused before any
connection is made."""
from __future__ import annotations

import ipaddress

import pytest

from server import images as im
from server.errors import APIError

EMBEDDED = ["http://[64:ff9b::a9fe:a9fe]/latest/meta-data",      # NAT64 of 169.254.169.254
            "http://[64:ff9b:1::a00:1]/a.png",                    # local-use NAT64 of 10.0.0.1
            "http://[2002:a9fe:a9fe::]/latest/meta-data",         # 6to4 of 169.254.169.254
            "http://[::127.0.0.1]/a.png",                         # IPv4-compatible loopback
            "http://[::ffff:7f00:1]:8000/a.png",                  # IPv4-mapped loopback
            "http://[2001:db8:1::200:5efe:c0a8:1]/a.png",         # ISATAP of 192.168.0.1
            "http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/a.png"]  # Teredo, client 10.0.0.1


@pytest.fixture
def no_connection(monkeypatch):
    """Any attempt to open a connection fails the test."""
    import httpx
    import socket

    def refuse(*a, **k):
        raise AssertionError(f"a connection was attempted: {a[:2]}")
    monkeypatch.setattr(httpx, "stream", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize("url", EMBEDDED)
def test_ipv6_forms_that_embed_a_private_ipv4_are_refused_without_a_connection(url, no_connection):
    with pytest.raises(APIError) as e:
        im.fetch(url, allow_urls=True)
    assert e.value.status == 400 and "non-public address" in e.value.message and "which carries" in e.value.message


def test_embedded_forms_of_public_ipv4_and_plain_ipv6_pass():
    """The twin: the decoding does not refuse everything with an IPv4 inside, only what reaches a private one."""
    im.check_destination("http://[64:ff9b::808:808]/a.png", allow_private=False)     # NAT64 of 8.8.8.8
    im.check_destination("http://[2002:808:808::1]/a.png", allow_private=False)      # 6to4 of 8.8.8.8
    im.check_destination("http://[2606:4700:4700::1111]/a.png", allow_private=False)
    assert im.embedded_ipv4(ipaddress.ip_address("2606:4700:4700::1111")) is None
    assert im.embedded_ipv4(ipaddress.ip_address("::1")) is None        # IPv6 loopback: refused as such
    assert str(im.embedded_ipv4(ipaddress.ip_address("2001:0:4136:e378:8000:63bf:f5ff:fffe"))) == "10.0.0.1"
