"""Where a connection or a request comes from, as the tracker and the peer servers count it.

An address is an IPv4 address or an IPv6 /64 (what one home or one machine holds; an IPv4 address inside
IPv6, ``::ffff:a.b.c.d``, counts as that IPv4 address), and its neighbourhood an IPv4 /24 or an IPv6 /48.
The machine's own processes (``127.0.0.1``, ``::1``: the demo, a volunteer beside its tracker, a reverse
proxy in front of it) are not counted: the operator runs them. Other loopback addresses count like any host
(the suite's tests use them to stand for separate hosts).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

THIS_MACHINE = frozenset({"127.0.0.1", "::1"})


@dataclass(frozen=True, slots=True)
class Origin:
    address: str  # the IPv4 address, or the IPv6 /64, identities are counted by
    subnet: str  # the IPv4 /24 or IPv6 /48 around it


def origin_of(remote: str | None) -> Origin | None:
    """The origin a request from ``remote`` counts for; None for this machine's own processes (and a
    request with no IP peer, e.g. over a Unix socket)."""
    if not remote or remote in THIS_MACHINE:
        return None
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
        if str(ip) in THIS_MACHINE:
            return None
    if isinstance(ip, ipaddress.IPv4Address):
        return Origin(str(ip), str(ipaddress.ip_network(f"{ip}/24", strict=False)))
    return Origin(
        str(ipaddress.ip_network(f"{ip}/64", strict=False)),
        str(ipaddress.ip_network(f"{ip}/48", strict=False)),
    )
