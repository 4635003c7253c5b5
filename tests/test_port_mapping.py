"""Automatic port mapping (issue 28): a volunteer at home behind a router running miniupnpd (UPnP-IGD and
NAT-PMP, Debian's package, in the router's namespace; tests/netns.py) asks it to forward its peer server's and
BitTorrent's ports, with no flag, and so becomes reachable for averaging and BitTorrent at its home's public
address; its forwards are gone once it has left. A second home whose router has no UPnP gets no forward and
trains through the first one, which owns every part.

Discovery packets stay inside the namespaces: only the volunteers here run with port mapping on (the suite
turns it off everywhere else, tests/conftest.py).
"""

from __future__ import annotations

import pytest

from tests.netns import Network, requires_netns
from tests.test_across_hosts import Published, reachability

pytestmark = [requires_netns, pytest.mark.slow, pytest.mark.timeout(300)]

MAPPING = ("CROWDTRAIN_PORT_MAPPING",)  # unset: the join's default, port mapping on


def test_a_volunteer_behind_a_upnp_router_is_reachable_with_no_flag_and_its_forwards_go_when_it_leaves(
    tmp_path,
):
    with Network(["tracker", "seeder", "h1", "h2"], homes=["h1", "h2"], upnp=["h1"]) as net:
        pub = Published(net, tmp_path, seed_with_token=False)
        h1 = net.hosts["h1"]
        vols = {n: pub.join(net.hosts[n], tmp_path, unset=MAPPING) for n in ("h1", "h2")}
        try:
            reach = {n: reachability(v) for n, v in vols.items()}
            # h2's router has no UPnP: h2 only sends; the steps it takes are averaged by h1 alone, whom the
            # tracker reaches only through h1's router's forward
            vols["h2"].wait_for("3 steps of h2", lambda: len(vols["h2"].of("StepDone")) >= 3, 180)
            forwards = net.forwards("h1")
            status = pub.status(h1)
        finally:
            codes = {n: v.interrupt(30) for n, v in vols.items()}
            left = net.forwards("h1")
            pub.stop()
        log = net.upnp_log("h1")
    pub.check_stopped()
    assert codes == {"h1": 130, "h2": 130}, {n: v.tail() for n, v in vols.items()}

    mapped = vols["h1"].of("PortMapped")
    granted = {(e["what"], e["port"], e["external_port"]) for e in mapped if e["external_port"]}
    [peer_port] = {p for what, p, _ in granted if what == "peer server"} or [None]
    [bt_port] = {p for what, p, _ in granted if what == "BitTorrent"} or [None]
    assert peer_port and bt_port, (mapped, log[-3000:])
    assert reach["h1"]["address"] == f"{h1.public_ip}:{peer_port}" and reach["h1"]["reachable"] is True, reach
    assert reach["h1"]["bt_address"] == f"{h1.public_ip}:{bt_port}" and reach["h1"]["bt_reachable"], reach
    assert f"reachable at {h1.public_ip}:{peer_port}" in status, status
    # the router held a forward of each port while h1 ran, and none once it had left
    for port in (peer_port, bt_port):
        assert any(f"dport {port} " in rule and f"{h1.ip}:{port}" in rule for rule in forwards), forwards
    assert left == [], left
    # h2 asked too, and nothing answered: it was told, and trained as a sender
    assert not [e for e in vols["h2"].of("PortMapped") if e["external_port"]], vols["h2"].of("PortMapped")
    assert reach["h2"]["reachable"] is not True and reach["h2"]["bt_reachable"] is False, reach
