"""Peer addresses: ``host:port`` and ``[ipv6]:port`` (the brackets were kept and the host never
resolved: "Name or service not known", found by a fresh user); anything else is a ValueError."""
import pytest

from node.runtime.peer_state import split_addr

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


@pytest.mark.parametrize("addr,expected", [("127.0.0.1:9100", ("127.0.0.1", 9100)), ("node-7:1", ("node-7", 1)),
                                           ("[::1]:9100", ("::1", 9100)), (" [fe80::2]:65535 ", ("fe80::2", 65535))])
def test_host_port_and_bracketed_ipv6(addr, expected):
    assert split_addr(addr) == expected


@pytest.mark.parametrize("addr", ["127.0.0.1", ":9100", "[::1]", "[]:9100", "[::1:9100", "h:0", "h:65536", "h:x"])
def test_malformed_addresses_are_refused(addr):
    with pytest.raises(ValueError):
        split_addr(addr)
