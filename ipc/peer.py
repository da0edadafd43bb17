"""Which local OS user is at the other end of a connection.

A Unix socket tells it directly (SO_PEERCRED). For a loopback TCP connection Linux lists
every socket in /proc/net/tcp and /proc/net/tcp6 with its owner's uid: the client's end
is the entry whose local address is our peer's and whose remote address is ours. Only
an established entry still held by a process (a non-zero inode) counts. Elsewhere, or
when no entry matches, the user is unknown (None).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from pathlib import Path

PROC_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_ESTABLISHED = "01"

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def unix_peer_uid(sock: socket.socket) -> int | None:
    """The uid of a Unix socket's peer (Linux's SO_PEERCRED), else None."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


def tcp_peer_uid(local: tuple[str, int], remote: tuple[str, int],
                 tables: tuple[Path, ...] = PROC_TABLES) -> int | None:
    """The uid owning the client end of the TCP connection from `remote` to our `local`
    (both as getsockname()/getpeername() give them), from the kernel's socket tables;
    None where they are not there or list no such connection."""
    if not sys.platform.startswith("linux"):
        return None
    ours, theirs = _address(local), _address(remote)
    if ours is None or theirs is None:
        return None
    for table in tables:
        try:
            text = table.read_text()
        except OSError:
            continue
        uid = _owner(text, local=theirs, remote=ours)
        if uid is not None:
            return uid
    return None


def _address(addr: tuple[str, int] | tuple[str, int, int, int]) -> Address | None:
    try:
        ip = ipaddress.ip_address(str(addr[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(addr[1])


def _owner(text: str, *, local: Address, remote: Address) -> int | None:
    """The uid of the table entry with these local and remote addresses."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _ESTABLISHED or fields[9] == "0":
            continue
        if _parse(fields[1]) == local and _parse(fields[2]) == remote:
            try:
                return int(fields[7])
            except ValueError:
                return None
    return None


def _parse(field: str) -> Address | None:
    """An address as the tables write it: the IP's 32-bit words in host byte order, in
    hex, then ':' and the port in hex."""
    try:
        hex_ip, hex_port = field.split(":")
        raw = bytes.fromhex(hex_ip)
        port = int(hex_port, 16)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    if sys.byteorder == "little":
        words = [w[::-1] for w in words]
    ip = ipaddress.ip_address(b"".join(words))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, port
