"""This machine's network addresses, as other machines see them. Standard library and psutil only;
nothing is sent (a UDP socket's ``connect`` only asks the kernel for the route). Local."""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional

__all__ = ["host_port", "source_address", "address_for_peers", "interface_of", "is_loopback", "names_this_machine",
           "resolves_to_loopback"]


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (given with or without them)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def source_address(host: str) -> Optional[str]:
    """This machine's address on the route to ``host`` (a name or an address, IPv6 in brackets or
    not): what the other machines can reach this one at. None when there is no route or ``host``
    does not resolve."""
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))
            return s.getsockname()[0]
    except OSError:
        return None


def address_for_peers(main_address: str) -> Optional[str]:
    """The address other machines of a job reach this one at: the one on the route to the job's
    main address, or, where that route is loopback (machine 0, whose host name resolves to
    127.0.1.1 as on Debian), the one on the default route. None when there is none."""
    address = source_address(main_address)
    if address is None or is_loopback(address):
        address = source_address("10.254.254.254")  # the default route (no packet is sent)
    return None if address is None or is_loopback(address) else address


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface that holds ``address`` (``eth0``), or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def is_loopback(address: str) -> bool:
    """True for 127.x.x.x and ::1."""
    return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback


def names_this_machine(host: str) -> bool:
    """``host`` is ``localhost`` or a loopback address: whoever uses it stays on this machine."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", ""):
        return True
    try:
        return is_loopback(host)
    except ValueError:
        return False  # a host name: could be any machine


def resolves_to_loopback(name: str) -> bool:
    """True when ``name`` (e.g. this machine's host name) resolves to a loopback address only, or
    not at all: peers cannot reach an address learned from it."""
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return True
    return all(is_loopback(info[4][0]) for info in infos)
