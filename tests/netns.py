"""A private test network: one Linux bridge and one network namespace per host, as if each host were its own
machine on a LAN, so tests can run the real ``crowdtrain`` CLI on separate addresses.

Each host gets a namespace with ``lo`` up (programs there may bind 127.0.0.1, which is the host's own
loopback) and ``eth0``, one end of a veth pair whose other end is a port of the bridge in the root namespace.
Hosts are 10.213.Y.2, .3, ... on a /24; the bridge has no address, so the root namespace (this test process)
has no route to the hosts and talks to them only through programs run inside them (:meth:`Host.popen`,
:meth:`Host.run`). The kernel here has no netem, so links are unshaped.

**Homes** (``Network(hosts, homes=[...])``): a host named in ``homes`` sits behind a home router of its own, a
namespace ``{host}-gw`` whose ``eth0`` is on the bridge (the home's public address, :attr:`Host.public_ip`)
and whose ``lan0`` is the home's LAN. Every home is 192.168.1.2 on 192.168.1.0/24 behind its router's
192.168.1.1, as real homes are. The router forwards and masquerades what the home sends out (``nft``) and
drops every connection begun from outside, like a home router without port forwarding: others reach a home
only on connections the home opened. A home also named in ``upnp`` has Debian's ``miniupnpd`` on its router
(UPnP-IGD and NAT-PMP on the LAN side only): it forwards the ports the home asks for, as most home routers do.
Its answers are in :meth:`Network.forwards`. With UPnP homes the bridge takes a public-looking subnet (44.213.x;
miniupnpd refuses to map ports behind a private WAN address); it is a bridge with no route out, as always.

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and ``ip`` (iproute2); :func:`netns_unavailable_reason` says
why not, and :data:`requires_netns` skips a test then. Homes need ``nft`` too (``make test`` installs Debian's
nftables as root); without it a test with homes fails with the command that installs it.

Everything made is named after this process's id, so concurrent test processes never collide, and removed on
exit from the ``with`` block, also when setup fails halfway or the test raises (an ``atexit`` hook catches
networks never closed). Leftovers of a process that was SIGKILLed are removed by the next :class:`Network`.

    with Network(hosts=["tracker", "v1"]) as net:
        server = net.hosts["tracker"].popen([sys.executable, "-m", "http.server", "8000"])
        net.hosts["v1"].run([sys.executable, "-c", f"...urlopen('http://{net.hosts['tracker'].ip}:8000')"])
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

IP = shutil.which("ip") or "/usr/sbin/ip"  # absolute: a caller's env without PATH must not hide it
NFT = shutil.which("nft") or "/usr/sbin/nft"
HOME_LAN = "192.168.1"  # every home's LAN: the home is .2, its router .1
# A home router: masquerade what leaves for the internet (eth0); forward what the home began and the answers to
# it, nothing begun from outside; the router itself answers nothing from outside.
# The chains named *miniupnpd are where a UPnP router's daemon adds the forwards it grants (empty otherwise).
HOME_ROUTER_RULES = """\
table inet nat {
    chain prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        jump prerouting_miniupnpd
    }
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        jump postrouting_miniupnpd
        oifname "eth0" masquerade
    }
    chain prerouting_miniupnpd {
    }
    chain postrouting_miniupnpd {
    }
}
table inet filter {
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        jump miniupnpd
        iifname "lan0" oifname "eth0" accept
    }
    chain miniupnpd {
    }
    chain input {
        type filter hook input priority filter; policy drop;
        ct state established,related accept
        iifname { "lo", "lan0" } accept
    }
}
"""
STOP_GRACE_S = 5.0
IP_TIMEOUT_S = 30.0

# Names: "ct" + this pid as 6 hex digits (pids are < 2**22) + this process's network counter, then
# "b" for the bridge, "v{i}" for host i's veth port; namespaces "ct-{pid:06x}-{n}-{host}". At most 15 chars
# for links (the kernel's IFNAMSIZ - 1): "ct" 2 + pid 6 + counter <= 3 + "v" 1 + index <= 3.
_LINK_RE = re.compile(r"ct([0-9a-f]{6})\d{1,3}(?:b|v\d{1,3})")
_NS_RE = re.compile(r"ct-([0-9a-f]{6})-\d+-[A-Za-z0-9_-]+")
_HOST_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_MAX_HOSTS = 250

_counter = itertools.count()
_open_networks: set[Network] = set()


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and ip's stderr."""


def _ip(*args: str) -> None:
    cmd = [IP, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")


def _ip_quiet(*args: str) -> None:
    """For teardown: best effort, a missing object is not an error."""
    subprocess.run([IP, *args], capture_output=True, timeout=IP_TIMEOUT_S)


@dataclass(eq=False)
class Host:
    """One namespace on the network: ``name`` as given, ``ns`` the namespace, ``ip`` its address on eth0; a
    home's ``public_ip`` is its router's address on the bridge (None: the host is on the bridge itself)."""

    name: str
    ns: str
    ip: str
    public_ip: str | None = None
    router_ns: str | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def popen(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
    ) -> subprocess.Popen:
        """Start ``args`` inside this host (``ip netns exec``), in a process group of its own. On teardown the
        network stops it (SIGTERM to the group, SIGKILL after ``stop_grace_s``) and closes its pipes."""
        proc = subprocess.Popen(
            [IP, "netns", "exec", self.ns, *args],
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def shape(self, rate: str, *, burst: str = "32kbit", latency: str = "400ms", dev: str = "eth0") -> None:
        """Limit what this host sends on ``dev`` to ``rate`` (e.g. ``"2mbit"``) with a ``tbf`` qdisc: a home
        uplink. The kernel here has ``tbf`` and ``htb``, not ``netem``: rate, but no added delay."""
        tc = shutil.which("tc") or "/usr/sbin/tc"
        cmd = [tc, "-n", self.ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
               "latency", latency]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
        if done.returncode != 0:
            raise NetnsError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")

    def run(
        self,
        args: Sequence[str],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside this host to completion; output captured as text, exit status not checked."""
        return subprocess.run(
            [IP, "netns", "exec", self.ns, *args],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


class Network:
    """``with Network(hosts=["tracker", "v1"]) as net:`` — ``net.hosts["v1"]`` is a :class:`Host`."""

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        homes: Sequence[str] = (),
        upnp: Sequence[str] = (),
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        names = list(hosts)
        if not names or len(names) > _MAX_HOSTS or len(set(names)) != len(names):
            raise ValueError(f"hosts must be 1 to {_MAX_HOSTS} distinct names, got {names!r}")
        if bad := [n for n in names if not _HOST_NAME_RE.fullmatch(n)]:
            raise ValueError(f"host names must be 1-32 of [A-Za-z0-9_-], got {bad!r}")
        if stray := set(homes) - set(names):
            raise ValueError(f"homes must be hosts of the network, not {sorted(stray)!r}")
        if stray := set(upnp) - set(homes):
            raise ValueError(f"upnp routers are homes' routers: {sorted(stray)!r} are not homes")
        pid, n = os.getpid(), next(_counter) % 1000
        # no route from here, so overlaps are harmless anyway
        self.subnet = f"{44 if upnp else 10}.213.{(pid + n) % 256}"
        self.upnp = list(upnp)
        self.tmp = Path(tempfile.mkdtemp(prefix="ct-netns-")) if upnp else None
        self.bridge = f"ct{pid:06x}{n}b"
        # on the bridge: each host not behind a router, and each home's router (with the home's public address)
        on_bridge = [f"{h}-gw" if h in homes else h for h in names]
        public = {name: f"{self.subnet}.{i + 2}" for i, name in enumerate(names)}
        self.hosts = {
            name: Host(
                name,
                ns=f"ct-{pid:06x}-{n}-{name}",
                ip=f"{HOME_LAN}.2" if name in homes else public[name],
                public_ip=public[name] if name in homes else None,
                router_ns=f"ct-{pid:06x}-{n}-{name}-gw" if name in homes else None,
            )
            for name in names
        }
        self._ports = {name: f"ct{pid:06x}{n}v{i}" for i, name in enumerate(on_bridge)}
        self.stop_grace_s = stop_grace_s
        self._made_links: list[str] = []
        self._made_namespaces: list[str] = []
        self._daemons: list[subprocess.Popen] = []  # the UPnP routers' miniupnpd

    def __enter__(self) -> Network:
        _open_networks.add(self)
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, host in self.hosts.items():
            if host.router_ns is None:
                self._attach(host.ns, self._ports[name], host.ip)
                continue
            assert host.public_ip is not None
            self._attach(host.router_ns, self._ports[f"{name}-gw"], host.public_ip)
            self._home(host)
            if name in self.upnp:
                self._start_upnp(host)

    def _start_upnp(self, host: Host) -> None:
        """miniupnpd on ``host``'s router, answering on its LAN; waits until it listens for NAT-PMP."""
        assert self.tmp is not None and host.router_ns is not None
        if not shutil.which("miniupnpd"):
            raise NetnsError("UPnP routers need miniupnpd: apt-get install -y miniupnpd-nftables")
        conf = self.tmp / f"{host.name}-miniupnpd.conf"
        conf.write_text(
            "ext_ifname=eth0\nlistening_ip=lan0\n"
            + "enable_natpmp=yes\nenable_upnp=yes\nsecure_mode=yes\nsystem_uptime=yes\n"
            + "upnp_table_name=filter\nupnp_nat_table_name=nat\nupnp_forward_chain=miniupnpd\n"
            + "upnp_nat_chain=prerouting_miniupnpd\nupnp_nat_postrouting_chain=postrouting_miniupnpd\n"
            + f"uuid={uuid.uuid4()}\n"
            + f"allow 1024-65535 {HOME_LAN}.0/24 1024-65535\ndeny 0-65535 0.0.0.0/0 0-65535\n"
        )
        log = (self.tmp / f"{host.name}-miniupnpd.log").open("w")
        daemon = subprocess.Popen(
            [IP, "netns", "exec", host.router_ns, "miniupnpd", "-d", "-f", str(conf), "-P",
             str(self.tmp / f"{host.name}-miniupnpd.pid")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()
        self._daemons.append(daemon)
        deadline = time.monotonic() + 10
        while "Listening for NAT-PMP" not in (self.tmp / f"{host.name}-miniupnpd.log").read_text():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise NetnsError(
                    f"miniupnpd did not start on {host.name}'s router: {self.upnp_log(host.name)}"
                )
            time.sleep(0.05)

    def upnp_log(self, home: str) -> str:
        """What ``home``'s router's miniupnpd printed so far."""
        assert self.tmp is not None
        path = self.tmp / f"{home}-miniupnpd.log"
        return path.read_text() if path.exists() else ""

    def forwards(self, home: str) -> list[str]:
        """The port forwards ``home``'s router holds now (its miniupnpd's nft rules), one line each."""
        router = self.hosts[home].router_ns
        assert router is not None
        done = subprocess.run(
            [IP, "netns", "exec", router, NFT, "list", "chain", "inet", "nat", "prerouting_miniupnpd"],
            capture_output=True, text=True, timeout=IP_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise NetnsError(f"nft on {home}'s router failed: {done.stderr.strip()}")
        return [line.strip() for line in done.stdout.splitlines() if "dnat" in line]

    def _attach(self, ns: str, port: str, ip: str) -> None:
        """A namespace with ``lo`` up and ``eth0`` at ``ip`` on the bridge."""
        _ip("netns", "add", ns)
        self._made_namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._made_links.append(port)
        _ip("link", "set", port, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def _home(self, host: Host) -> None:
        """``host`` behind its router (already on the bridge): the LAN between them, the router's rules."""
        router = host.router_ns
        assert router is not None
        if not shutil.which("nft"):
            raise NetnsError("home routers need the `nft` command: apt-get install -y nftables")
        _ip("netns", "add", host.ns)
        self._made_namespaces.append(host.ns)
        _ip("-n", host.ns, "link", "set", "lo", "up")
        _ip("-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", router, "addr", "add", f"{HOME_LAN}.1/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "route", "add", "default", "via", f"{HOME_LAN}.1")
        for command in (["sysctl", "-qw", "net.ipv4.ip_forward=1"], [NFT, "-f", "-"]):
            done = subprocess.run(
                [IP, "netns", "exec", router, *command],
                input=HOME_ROUTER_RULES if command[0] == NFT else None,
                capture_output=True,
                text=True,
                timeout=IP_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise NetnsError(f"`{' '.join(command)}` in {router} failed: {done.stderr.strip()}")

    def close(self) -> None:
        """Stop every process started in the hosts, then remove every link and namespace made. Idempotent."""
        try:
            procs = [p for host in self.hosts.values() for p in host._procs]
            _stop(procs, self.stop_grace_s)
            _stop(self._daemons, self.stop_grace_s)
            self._daemons.clear()
            for host in self.hosts.values():
                host._procs.clear()
            for ns in self._made_namespaces:
                _kill_namespace_pids(ns)  # anything that left its process group
            # Links first: deleting a namespace frees its end of the veth only later, asynchronously.
            for link in reversed(self._made_links):
                _ip_quiet("link", "del", link)
            for ns in reversed(self._made_namespaces):
                _ip_quiet("netns", "del", ns)
            self._made_links.clear()
            self._made_namespaces.clear()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            _open_networks.discard(self)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after the grace, reap all and close their pipes."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        for pipe in (p.stdin, p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


def _kill_namespace_pids(ns: str) -> None:
    found = subprocess.run([IP, "netns", "pids", ns], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove links and namespaces left by test processes that died without teardown (SIGKILL)."""
    namespaces = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for line in namespaces.stdout.splitlines():
        ns = line.split(" ", 1)[0]
        if (m := _NS_RE.fullmatch(ns)) and not _pid_alive(int(m[1], 16)):
            _kill_namespace_pids(ns)
            _ip_quiet("netns", "del", ns)
    links = subprocess.run([IP, "-o", "link", "show"], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    for line in links.stdout.splitlines():
        # "7: ct0012abv0@if2: <BROADCAST,...": the name ends at "@" (a veth's peer) or ":".
        name = re.split(r"[@:]", line.split(": ", 1)[1], maxsplit=1)[0] if ": " in line else ""
        if (m := _LINK_RE.fullmatch(name)) and not _pid_alive(int(m[1], 16)):
            _ip_quiet("link", "del", name)


@atexit.register
def _close_open_networks() -> None:
    for net in list(_open_networks):
        net.close()


@functools.cache
def netns_unavailable_reason() -> str | None:
    """None when namespaces, veth pairs and bridges can be made here (tried once, then cleaned up); else why
    not, as a sentence."""
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_SYS_ADMIN and CAP_NET_ADMIN); this is not root"
    try:
        with Network(hosts=["probe"]):
            pass
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make a namespace, veth pair and bridge here: {e}"
    return None


requires_netns = pytest.mark.skipif(
    netns_unavailable_reason() is not None,
    reason=f"needs network namespaces: {netns_unavailable_reason()}",
)
