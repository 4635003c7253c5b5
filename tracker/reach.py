"""Where a volunteer is reached, and whether it really is: the tracker's side of "reachability".

* A volunteer declares its peer server as ``":PORT"`` (the default): the tracker fills in the address it
  sees the request come from, as a BitTorrent tracker does with an announce. ``None`` is client mode.
* **The tracker never probes for others.** A declared host (``join --advertise``) must be the address the
  request came from, compared as parsed addresses (an IPv4-mapped IPv6 address is its IPv4 one), else it is
  refused with a sentence: nobody can point the tracker's checks at another host. A tracker started with
  ``--allow-other-hosts`` (relays, a forward on another address) takes other hosts, but never a loopback
  (unless the volunteer is on loopback too), link-local, unspecified, multicast or reserved one, however
  spelled: a name, or a numeric spelling Python does not parse (``127.1``, ``2130706433``, ``0x7f.1``,
  ``LOCALHOST.``), is resolved at check time and each address it resolves to is held to the same rule.
* The tracker checks a declared address off the request path with ``GET /v1/ping`` (which must answer this
  peer's id), and the BitTorrent port the volunteer reports with a BitTorrent handshake for the run's data
  set (the answer must be a handshake for the same info-hash: a TCP accept is not enough); both at the first
  heartbeat that names them, on a change, and while they fail, every ``RECHECK_S``.
* A peer owns an all-reduce part only when its check answered; matchmaking never forms a group without a
  part owner (see :mod:`crowdtrain.tracker.collab`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import time

from crowdtrain.protocol.aio import BodyTooLong, read_body
from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.protocol.peerclient import PeerClient, PeerUnreachable
from crowdtrain.tracker.peers import Peer, Reach

log = logging.getLogger("crowdtrain.tracker")

RECHECK_S = 10.0  # an unreachable address is checked again this often (on heartbeats)
BT_PROTOCOL = b"\x13BitTorrent protocol"
CHECKER_PEER_ID = b"-CT0000-reachability"  # 20 bytes: the tracker's peer id in its handshakes


class AddressError(ProtocolError):
    """A declared address that cannot be used (answered with 400)."""


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(host: str) -> IP | None:
    """``host`` as an address (brackets stripped, an IPv4-mapped IPv6 address as its IPv4 one); None for a
    name, or a spelling only a resolver reads (``127.1``)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def forbidden(ip: IP, remote: str | None) -> str | None:
    """Why the tracker must not check ``ip`` for a volunteer at ``remote`` (None: it may)."""
    if ip.is_loopback:
        seen = parse_ip(remote) if remote else None
        return None if seen is not None and seen.is_loopback else "a loopback address"
    for kind, bad in (
        ("an unspecified address", ip.is_unspecified),
        ("a link-local address", ip.is_link_local),
        ("a multicast address", ip.is_multicast),
        ("a reserved address", ip.is_reserved),
    ):
        if bad:
            return kind
    return None


def _is_loopback(host: str) -> bool:
    ip = parse_ip(host)
    return ip.is_loopback if ip is not None else host.lower().rstrip(".") == "localhost"


def resolve_address(address: str, remote: str | None, *, other_hosts: bool = False) -> str:
    """The ``host:port`` others reach a peer at, from what it declared and where its request came from.

    An empty or unspecified host (``:PORT``, ``0.0.0.0:PORT``, ``[::]:PORT``) stands for ``remote``. Another
    host must be ``remote`` itself, unless ``other_hosts`` (then see the module docstring).
    """
    if len(address) > 300:
        raise AddressError("address is longer than 300 characters")
    host, sep, port_text = address.rpartition(":")
    if not sep or not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise AddressError(f"address {address!r} must be host:port with a port between 1 and 65535")
    if host in ("", "0.0.0.0", "::", "[::]"):
        if not remote:
            raise AddressError(f"address {address!r} has no host and the connection's address is unknown")
        host = f"[{remote}]" if ":" in remote else remote
    if any(c.isspace() or c in "/?#@" for c in host):
        raise AddressError(f"address {address!r} has an invalid host")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise AddressError(f"address {address!r}: write an IPv6 host in brackets, e.g. [::1]:8000")
    if _is_loopback(host) and remote and not _is_loopback(remote):
        raise AddressError(
            f"address {address!r} is a loopback address, but this volunteer talks to the tracker from "
            f"{remote}: other volunteers cannot reach it there; leave out --advertise (the tracker then uses "
            f"{remote}) or advertise an address they can reach"
        )
    ip, seen = parse_ip(host), parse_ip(remote) if remote else None
    if not other_hosts and remote and (ip is None or ip != seen):
        raise AddressError(
            f"address {address!r}: this tracker checks a volunteer only at the address its requests come from "
            f"({remote}), so that nobody can point its checks at another host; leave out --advertise's host "
            "(e.g. --advertise :PORT for a forwarded port), or ask the tracker's operator to start it with "
            "--allow-other-hosts (for relays)"
        )
    if ip is not None and (why := forbidden(ip, remote)):
        raise AddressError(f"address {address!r} is {why}: the tracker does not check such addresses")
    return f"{host}:{int(port_text)}"


def host_of(address: str) -> str:
    return address.rpartition(":")[0]


class Checker:
    """Runs the reachability checks of one tracker, at most ``concurrency`` at once."""

    def __init__(self, timeout_s: float, concurrency: int, tasks: asyncio.TaskGroup) -> None:
        self.timeout_s = timeout_s
        self._tasks = tasks
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task[None]] = set()
        self._http: PeerClient | None = None

    async def start(self) -> None:
        self._http = PeerClient()

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        if self._http is not None:
            await self._http.close()

    def _spawn(self, coro) -> None:
        task = self._tasks.create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    # ------------------------------------------------------------ on every heartbeat

    def update(
        self, peer: Peer, address: str | None, bt_port: int | None, remote: str, infohash: str = ""
    ) -> None:
        """Take what a join or heartbeat said of the peer's addresses; start the checks that are due
        (``infohash``: the run's data set, hex, for the BitTorrent handshake)."""
        reach = peer.reach
        if address != reach.address:
            reach.address = address
            reach.reachable = reach.checked = False
            reach.checks = 0
        bt_address = None
        if bt_port is not None:
            host = host_of(address) if address is not None else (f"[{remote}]" if ":" in remote else remote)
            bt_address = f"{host}:{bt_port}" if host else None
        if bt_address != reach.bt_address:
            reach.bt_address = bt_address
            reach.bt_reachable = None
            reach.bt_checked_at = 0.0
        now = time.monotonic()
        if (
            reach.address is not None
            and not reach.checking
            and not reach.reachable
            and (reach.checks < 2 or now - reach.checked_at >= RECHECK_S)
        ):
            reach.checking = True
            reach.checks += 1
            reach.checked_at = now
            self._spawn(self._ping(peer.peer_id, reach, reach.address, remote))
        if (
            reach.bt_address is not None
            and not reach.bt_checking
            and reach.bt_reachable is not True
            and now - reach.bt_checked_at >= (0.0 if reach.bt_reachable is None else RECHECK_S)
        ):
            reach.bt_checking = True
            reach.bt_checked_at = now
            self._spawn(self._handshake(peer.peer_id, reach, reach.bt_address, infohash, remote))

    # ------------------------------------------------------------ the checks

    # A check writes its answer into the peer's Reach only while that still holds the address it checked; a
    # peer that left (or re-registered, with a new Reach) takes no answer: its old record is dropped with it.

    async def _allowed(self, address: str, remote: str) -> bool:
        """Whether every address ``address``'s host resolves to may be checked (a name, or a spelling only a
        resolver reads, is resolved here; see :func:`forbidden`)."""
        host = host_of(address).strip("[]")
        if parse_ip(host) is not None:
            return True  # (checked when it was declared)
        try:
            found = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return False
        ips = [parse_ip(str(info[4][0])) for info in found]
        return bool(ips) and all(ip is not None and forbidden(ip, remote) is None for ip in ips)

    async def _ping(self, peer_id: str, reach: Reach, address: str, remote: str = "") -> None:
        assert self._http is not None
        ok = False
        async with self._slots:
            try:
                if not await self._allowed(address, remote):
                    raise ValueError(f"{address} resolves to an address the tracker does not check")
                async with asyncio.timeout(self.timeout_s):
                    async with self._http.get(address, "/v1/ping") as resp:
                        if resp.status == 200:
                            body = await read_body(resp.content, 4096, resp.content_length)
                            reply = json.loads(body)
                            ok = isinstance(reply, dict) and reply.get("peer_id") == peer_id
            except (PeerUnreachable, OSError, TimeoutError, ValueError, BodyTooLong) as exc:
                # refused, reset, timed out, not HTTP, not JSON, too long: the address does not answer as a peer
                log.debug("peer %s at %s is not reachable: %s", peer_id, address, exc)
            except Exception:  # a bug of ours, not the peer's: unreachable all the same, but said aloud
                log.warning("checking peer %s at %s failed unexpectedly", peer_id, address, exc_info=True)
        reach.checking = False
        if reach.address == address:
            reach.reachable = ok
            reach.checked = True
            if not ok:
                log.info("peer %s declared %s but did not answer GET /v1/ping; client mode", peer_id, address)

    async def _handshake(self, peer_id: str, reach: Reach, address: str, infohash: str, remote: str) -> None:
        """A BitTorrent handshake for the run's data set at ``address``: reachable when the answer is a
        handshake for the same info-hash."""
        host, _, port = address.rpartition(":")
        ok = False
        async with self._slots:
            try:
                if len(infohash) != 40 or not await self._allowed(address, remote):
                    raise ValueError("no data set to ask for, or an address the tracker does not check")
                ours = BT_PROTOCOL + bytes(8) + bytes.fromhex(infohash) + CHECKER_PEER_ID
                async with asyncio.timeout(self.timeout_s):
                    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
                    try:
                        writer.write(ours)
                        await writer.drain()
                        theirs = await reader.readexactly(len(ours))
                    finally:
                        writer.close()
                        with contextlib.suppress(OSError):
                            await writer.wait_closed()
                ok = theirs[:20] == BT_PROTOCOL and theirs[28:48] == ours[28:48]
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
                log.debug("BitTorrent port of peer %s at %s is not reachable: %s", peer_id, address, exc)
        reach.bt_checking = False
        if reach.bt_address == address:
            reach.bt_reachable = ok
