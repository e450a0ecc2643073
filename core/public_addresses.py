"""Which network addresses the platform may send a tenant's request to (webhooks): the one place
that says what is public, so a tenant cannot point the platform at its own insides (SSRF).

Always refused: unspecified (``0.0.0.0``, ``::``, and ``0.0.0.0/8``, which Linux reads as "this
host"), multicast, link-local (``169.254.0.0/16``: the clouds' metadata service; ``fe80::/10``) and
reserved addresses (``240.0.0.0/4``, broadcast). Private and loopback addresses (``10/8``,
``127/8``, ``::1``, ``fc00::/7``, shared ``100.64/10``, documentation ranges) only where the
operator allows them (``WEBHOOKS_ALLOW_PRIVATE_ADDRESSES``: on-premises receivers, the tests).
An IPv6 address that carries an IPv4 one (IPv4-mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``,
6to4 ``2002::/16``) is judged by the IPv4 address it reaches.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

IPAddress = IPv4Address | IPv6Address

_THIS_NETWORK = IPv4Network("0.0.0.0/8")
_NAT64 = IPv6Network("64:ff9b::/96")

PUBLIC, PRIVATE, LOOPBACK = "public", "private", "loopback"
ALLOWED_WITH_SETTING = (PRIVATE, LOOPBACK)


def reached(address: IPAddress) -> IPAddress:
    """The address a packet sent to ``address`` ends up at: the IPv4 one an IPv6 address embeds."""
    if isinstance(address, IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def kind(address: IPAddress) -> str:
    """PUBLIC, PRIVATE, LOOPBACK, or the name of a kind that is never allowed."""
    address = reached(address)
    if address.is_unspecified or (isinstance(address, IPv4Address) and address in _THIS_NETWORK):
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if address.is_link_local:
        return "link-local"
    if address.is_loopback:
        return LOOPBACK
    if address.is_reserved:
        return "reserved"
    return PUBLIC if address.is_global else PRIVATE


def refusal(address: IPAddress, allow_private: bool) -> str | None:
    """Why the platform must not connect to ``address`` (for a message that does not show the
    address), or None when it may."""
    found = kind(address)
    if found == PUBLIC or (allow_private and found in ALLOWED_WITH_SETTING):
        return None
    return f"a {found} address"


def literal(host: str) -> IPAddress | None:
    """``host`` as an IP address when it is written as one (``[::1]`` without its brackets), else None."""
    try:
        return ip_address(host)
    except ValueError:
        return None
