"""Where a volunteer is reached: the address the tracker records from what it declared and where its
request came from, and what it will never check (another host, loopback, link-local, reserved, however
spelt); the BitTorrent check against real sockets (the checks of volunteers run in test_tracker_api/collab)."""

from __future__ import annotations

import asyncio

import pytest

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.tracker.peers import Reach
from crowdtrain.tracker.reach import AddressError, Checker, resolve_address
from crowdtrain.volunteer.config import VolunteerConfig, split_advertise


@pytest.mark.parametrize(
    ("declared", "remote", "recorded"),
    [
        (":4000", "10.0.0.7", "10.0.0.7:4000"),  # the default: the source address of the request
        ("0.0.0.0:4000", "10.0.0.7", "10.0.0.7:4000"),
        ("[::]:4000", "2001:db8::7", "[2001:db8::7]:4000"),
        ("10.0.0.7:5000", "10.0.0.7", "10.0.0.7:5000"),  # --advertise its own address
        ("[::ffff:10.0.0.7]:5000", "10.0.0.7", "[::ffff:10.0.0.7]:5000"),  # the same address, spelt as IPv6
    ],
)
def test_the_recorded_address_is_the_declared_one_or_the_source_of_the_request(declared, remote, recorded):
    assert resolve_address(declared, remote) == recorded


@pytest.mark.parametrize(
    ("declared", "remote", "recorded"),
    [
        ("203.0.113.9:5000", "10.0.0.7", "203.0.113.9:5000"),  # a relay
        ("relay.example.org:443", "10.0.0.7", "relay.example.org:443"),  # a name: resolved when checked
        ("127.0.0.3:4000", "127.0.0.1", "127.0.0.3:4000"),  # loopback from loopback: one machine
    ],
)
def test_a_tracker_that_allows_other_hosts_takes_them(declared, remote, recorded):
    assert resolve_address(declared, remote, other_hosts=True) == recorded


OTHER = "only at the address its requests come from"


@pytest.mark.parametrize(
    ("declared", "remote", "says"),
    [
        ("127.0.0.1:4000", "10.0.0.7", "is a loopback address, but this volunteer talks to the tracker from"),
        ("localhost:4000", "10.0.0.7", "leave out --advertise"),
        ("LOCALHOST.:4000", "10.0.0.7", "leave out --advertise"),
        ("[::ffff:127.0.0.1]:4000", "10.0.0.7", "is a loopback address"),
        # another host, however spelt: the tracker would be a port scanner for whoever asks
        ("203.0.113.9:5000", "10.0.0.7", OTHER),
        ("relay.example.org:443", "10.0.0.7", OTHER),
        ("127.1:4000", "10.0.0.7", OTHER),
        ("2130706433:4000", "10.0.0.7", OTHER),
        ("0x7f.1:4000", "10.0.0.7", OTHER),
        ("127.0.0.3:4000", "127.0.0.1", OTHER),
        (":0", "10.0.0.7", "port between 1 and 65535"),
        ("10.0.0.7", "10.0.0.7", "must be host:port"),
        (":4000", None, "connection's address is unknown"),
        ("a b:4000", "10.0.0.7", "invalid host"),
        ("::1:4000", "10.0.0.7", "IPv6 host in brackets"),
        ("x" * 301, "10.0.0.7", "longer than 300"),
    ],
)
def test_an_address_nobody_could_use_is_refused_with_a_sentence(declared, remote, says):
    with pytest.raises(AddressError, match=says):
        resolve_address(declared, remote)


@pytest.mark.parametrize(
    ("declared", "says"),
    [
        ("169.254.169.254:80", "link-local"),  # a cloud's metadata service
        ("[fe80::1]:80", "link-local"),
        ("224.0.0.1:80", "multicast"),
        ("240.0.0.1:80", "reserved"),
        ("[::ffff:127.0.0.1]:80", "loopback"),
        ("127.0.0.1:80", "loopback"),
    ],
)
def test_even_a_tracker_that_allows_other_hosts_never_checks_loopback_link_local_or_reserved(declared, says):
    with pytest.raises(AddressError, match=says):
        resolve_address(declared, "10.0.0.7", other_hosts=True)


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f.1"])
async def test_a_spelling_only_a_resolver_reads_is_resolved_and_held_to_the_same_rule(host):
    """(Numeric spellings getaddrinfo reads without asking DNS.)"""
    async with asyncio.TaskGroup() as tasks:
        checker = Checker(1.0, 1, tasks)
        assert not await checker._allowed(f"{host}:80", "10.0.0.7")  # loopback, for a volunteer elsewhere
        assert await checker._allowed(f"{host}:80", "127.0.0.1")  # a test on one machine


async def test_the_bittorrent_check_wants_a_handshake_for_the_run_s_data_set_not_just_an_accept():
    """A port that accepts a TCP connection but does not answer as a BitTorrent peer of the data set (here the
    tracker-like HTTP-ish server below, and a peer of another torrent) is not reachable for BitTorrent."""
    infohash = "ab" * 20

    async def not_bittorrent(reader, writer):
        await reader.read(68)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
        await writer.drain()
        writer.close()

    async def other_torrent(reader, writer):
        theirs = await reader.readexactly(68)
        writer.write(theirs[:28] + bytes.fromhex("cd" * 20) + b"-XX0000-000000000000")
        await writer.drain()
        writer.close()

    async def same_torrent(reader, writer):
        theirs = await reader.readexactly(68)
        writer.write(theirs[:48] + b"-XX0000-000000000000")
        await writer.drain()
        writer.close()

    answers = {}
    async with asyncio.TaskGroup() as tasks:
        checker = Checker(5.0, 4, tasks)
        for name, handler in (("http", not_bittorrent), ("other", other_torrent), ("same", same_torrent)):
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            reach = Reach(bt_address=f"127.0.0.1:{port}")
            async with server:
                await checker._handshake("p", reach, f"127.0.0.1:{port}", infohash, "127.0.0.1")
            answers[name] = reach.bt_reachable
        await checker.close()
    assert answers == {"http": False, "other": False, "same": True}


def test_advertise_takes_a_host_or_host_and_port(tmp_path):
    assert split_advertise("203.0.113.9") == ("203.0.113.9", None)
    assert split_advertise("203.0.113.9:5000") == ("203.0.113.9", 5000)
    assert split_advertise("[2001:db8::1]:5000") == ("[2001:db8::1]", 5000)
    assert split_advertise("2001:db8::1") == ("2001:db8::1", None)
    base = {"run_id": "r", "tracker_url": "http://t:1", "data_dir": tmp_path}
    for bad, field in [
        ({"advertise": "1.2.3.4:99999"}, "advertise"),
        ({"advertise": "0.0.0.0"}, "advertise"),
        ({"advertise": ":"}, "advertise"),
        ({"advertise": "1.2.3.4", "client_mode": True}, "advertise"),
        ({"bt_port": 70000}, "bt_port"),
    ]:
        with pytest.raises(ConfigError) as info:
            VolunteerConfig(**base, **bad)
        assert info.value.field == field
    assert VolunteerConfig(**base).host == "0.0.0.0"  # every interface by default
    assert VolunteerConfig(**base, advertise=":5000").advertise == ":5000"  # a router's forward to this host
