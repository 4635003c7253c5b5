"""Where a volunteer is reached: the address the tracker records from what it declared and where its
request came from (pure; the checks themselves run against real servers in test_tracker_api/collab)."""

from __future__ import annotations

import pytest

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.tracker.reach import AddressError, resolve_address
from crowdtrain.volunteer.config import VolunteerConfig, split_advertise


@pytest.mark.parametrize(
    ("declared", "remote", "recorded"),
    [
        (":4000", "10.0.0.7", "10.0.0.7:4000"),  # the default: the source address of the request
        ("0.0.0.0:4000", "10.0.0.7", "10.0.0.7:4000"),
        ("[::]:4000", "2001:db8::7", "[2001:db8::7]:4000"),
        ("203.0.113.9:5000", "10.0.0.7", "203.0.113.9:5000"),  # --advertise: as given
        ("relay.example.org:443", "10.0.0.7", "relay.example.org:443"),
        ("127.0.0.3:4000", "127.0.0.1", "127.0.0.3:4000"),  # loopback from loopback: a test on one machine
    ],
)
def test_the_recorded_address_is_the_declared_one_or_the_source_of_the_request(declared, remote, recorded):
    assert resolve_address(declared, remote) == recorded


@pytest.mark.parametrize(
    ("declared", "remote", "says"),
    [
        ("127.0.0.1:4000", "10.0.0.7", "is a loopback address, but this volunteer talks to the tracker from"),
        ("localhost:4000", "10.0.0.7", "leave out --advertise"),
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


def test_advertise_takes_a_host_or_host_and_port(tmp_path):
    assert split_advertise("203.0.113.9") == ("203.0.113.9", None)
    assert split_advertise("203.0.113.9:5000") == ("203.0.113.9", 5000)
    assert split_advertise("[2001:db8::1]:5000") == ("[2001:db8::1]", 5000)
    assert split_advertise("2001:db8::1") == ("2001:db8::1", None)
    base = {"run_id": "r", "tracker_url": "http://t:1", "data_dir": tmp_path}
    for bad, field in [
        ({"advertise": "1.2.3.4:99999"}, "advertise"),
        ({"advertise": "0.0.0.0"}, "advertise"),
        ({"advertise": "1.2.3.4", "client_mode": True}, "advertise"),
        ({"bt_port": 70000}, "bt_port"),
    ]:
        with pytest.raises(ConfigError) as info:
            VolunteerConfig(**base, **bad)
        assert info.value.field == field
    assert VolunteerConfig(**base).host == "0.0.0.0"  # every interface by default
