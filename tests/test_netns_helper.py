"""The test network of tests/netns.py: hosts reach each other over TCP at their addresses, each host's loopback
is its own, and teardown removes every namespace, link and process, however the block ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import netns
from tests.netns import Network, requires_netns

pytestmark = requires_netns

PORT = 8000

# Prints the HTTP status of the URL in argv[1]; with "--wait", retries until the server is up (20 s at most).
FETCH = textwrap.dedent(
    """
    import sys, time, urllib.request
    url, wait = sys.argv[1], "--wait" in sys.argv
    deadline = time.monotonic() + (20 if wait else 0)
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                print(response.status)
                break
        except OSError as e:
            if time.monotonic() >= deadline:
                print(type(e).__name__, e)
                sys.exit(1)
            time.sleep(0.1)
    """
)


def fetch(host: netns.Host, url: str, *, wait: bool = False) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-c", FETCH, url, *(["--wait"] if wait else [])], timeout=60)


def leftovers(net: Network) -> tuple[set[str], set[str]]:
    """The namespaces and links of ``net`` that still exist."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    namespaces = {line.split(" ", 1)[0] for line in listed.splitlines()}
    shown = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    links = {line.split(": ")[1].split("@")[0] for line in shown.splitlines()}
    ours_ns = {h.ns for h in net.hosts.values()} | {h.router_ns for h in net.hosts.values() if h.router_ns}
    ours_links = {net.bridge, *net._ports.values()}
    return namespaces & ours_ns, links & ours_links


def test_a_host_reaches_another_at_its_address_but_not_at_its_own_loopback():
    with Network(hosts=["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        assert a.ip != b.ip
        a.popen(
            [sys.executable, "-m", "http.server", "--bind", "0.0.0.0", str(PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        across = fetch(b, f"http://{a.ip}:{PORT}/", wait=True)
        assert (across.returncode, across.stdout.strip()) == (0, "200"), across

        own_loopback = fetch(a, f"http://127.0.0.1:{PORT}/")
        assert (own_loopback.returncode, own_loopback.stdout.strip()) == (0, "200"), own_loopback

        others_loopback = fetch(b, f"http://127.0.0.1:{PORT}/")
        assert others_loopback.returncode == 1, others_loopback
        assert "ConnectionRefusedError" in others_loopback.stdout or "Connection refused" in (
            others_loopback.stdout
        )


def test_teardown_removes_namespaces_links_and_processes():
    with Network(hosts=["tracker", "seeder", "v1"]) as net:
        assert leftovers(net) == ({h.ns for h in net.hosts.values()}, {net.bridge, *net._ports.values()})
        sleeper = net.hosts["v1"].popen(["sleep", "1000"])
    assert leftovers(net) == (set(), set())
    assert sleeper.returncode is not None


def test_teardown_also_when_the_block_raises():
    with pytest.raises(RuntimeError, match="test failed"), Network(hosts=["a", "b"], stop_grace_s=0.5) as net:
        # Ignores SIGTERM once it says so: teardown must fall back to SIGKILL.
        stubborn = net.hosts["a"].popen(
            ["sh", "-c", "trap '' TERM; echo ready; sleep 1000"], stdout=subprocess.PIPE, text=True
        )
        assert stubborn.stdout.readline() == "ready\n"
        raise RuntimeError("test failed")
    assert leftovers(net) == (set(), set())
    assert stubborn.returncode == -signal.SIGKILL


def test_teardown_also_when_setup_fails_halfway(monkeypatch):
    calls = 0
    real_ip = netns._ip

    def failing_ip(*args: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 6:  # after the bridge and the first host's namespace and veth pair exist
            raise netns.NetnsError("injected failure")
        real_ip(*args)

    monkeypatch.setattr(netns, "_ip", failing_ip)
    net = Network(hosts=["a", "b"])
    with pytest.raises(netns.NetnsError, match="injected failure"), net:
        pass
    assert calls == 6
    assert leftovers(net) == (set(), set())


def test_leftovers_of_a_killed_test_process_are_removed_by_the_next_network(tmp_path):
    # A process builds a network and is SIGKILLed inside the block: nothing of its own runs to clean up.
    script = textwrap.dedent(
        """
        import os, signal, sys
        from tests.netns import Network
        net = Network(hosts=["x"]).__enter__()
        print(net.bridge, net._ports["x"], net.hosts["x"].ns, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    killed = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    bridge, port, ns = killed.stdout.split()
    assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with Network(hosts=["y"]):
        pass
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert bridge not in links and port not in links


def test_a_home_behind_its_router_reaches_out_masqueraded_and_nothing_reaches_in(tmp_path):
    """Two homes behind routers doing nft masquerade, both 192.168.1.2 as real homes are: a home fetches
    from a server, which sees the home's public address; neither the server nor the other home gets in."""
    with Network(hosts=["server", "h1", "h2"], homes=["h1", "h2"]) as net:
        server, h1, h2 = net.hosts["server"], net.hosts["h1"], net.hosts["h2"]
        assert h1.ip == h2.ip == "192.168.1.2" and server.public_ip is None
        assert h1.public_ip and h2.public_ip and len({server.ip, h1.public_ip, h2.public_ip}) == 3
        log = tmp_path / "served.log"
        with log.open("w") as served_to:  # the server's access log: who it saw
            for host in (server, h1):
                host.popen(
                    [sys.executable, "-m", "http.server", "--bind", "0.0.0.0", str(PORT)],
                    stdout=subprocess.DEVNULL,
                    stderr=served_to if host is server else subprocess.DEVNULL,
                )
        out = fetch(h1, f"http://{server.ip}:{PORT}/", wait=True)
        assert (out.returncode, out.stdout.strip()) == (0, "200"), out
        at_home = fetch(h1, f"http://127.0.0.1:{PORT}/", wait=True)  # (h1's own server is up)
        assert at_home.returncode == 0, at_home
        for source in (server, h2):
            blocked = fetch(source, f"http://{h1.public_ip}:{PORT}/")
            assert blocked.returncode == 1, blocked
            private = fetch(source, f"http://{h1.ip}:{PORT}/")  # (h2's own 192.168.1.2 has nothing on PORT)
            assert private.returncode == 1, private
    assert leftovers(net) == (set(), set())
    served = log.read_text()
    assert f"{h1.public_ip} - -" in served and "192.168.1.2" not in served, served
