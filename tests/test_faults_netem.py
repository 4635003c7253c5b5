"""Group all-reduce between three processes in three network namespaces, joined by a bridge, with a degraded
link on every peer: added latency, jitter and packet loss (``tc netem``), or a slow link (``tc tbf``). Every
round completes with the exact weighted mean (codec none), and no part is dropped.

Needs root, ``ip netns`` and the qdisc in the kernel; each variant is skipped with the reason otherwise (on
the development VM the kernel has no ``sch_netem``, so only the ``tbf`` variant runs there). Each peer is a real Averager behind
a real aiohttp server in its own namespace (``ip netns exec``); assignments and credentials are signed here
with a tracker key, as the tracker would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from crowdtrain.protocol.credentials import SigningKey, issue_credential, sign_assignment
from crowdtrain.protocol.messages import GroupAssignment, GroupMember, encode
from tests.faults import record_outcome, subprocess_env

RUN = "run-netem"
PEERS = 3
WEIGHTS = [3, 1, 2]
ELEMENTS = 300_000  # 1.2 MB of float32 per peer
LINKS = {
    "netem": ["netem", "delay", "25ms", "5ms", "loss", "2%"],  # latency, jitter and loss
    "tbf": ["tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"],  # a 20 Mbit/s link
}
ROUNDS_DEGRADED = 4

PEER = r"""
import asyncio, json, sys, time
import numpy as np
from aiohttp import web
from crowdtrain.protocol.codecs import Codec
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import Credential, GroupAssignment, decode
from crowdtrain.volunteer.averaging import Averager, AveragingConfig

async def main():
    loop = asyncio.get_running_loop()
    setup = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    averager = Averager(
        run_id=setup["run_id"], tracker_public_key=setup["tracker"], peer_id=setup["peer_id"],
        key=SigningKey.from_bytes(bytes.fromhex(setup["key"])),
        credential=decode(setup["credential"], Credential),
        config=AveragingConfig(codec=Codec.NONE, clip_multiple=0.0, connect_timeout_s=10.0),
    )
    app = web.Application()
    app.add_routes(averager.routes())
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, setup["host"], 0).start()
    print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        msg = json.loads(line)
        vector = np.random.default_rng(msg["seed"]).standard_normal(msg["n"]).astype(np.float32)
        started = time.monotonic()
        result = await averager.allreduce(decode(msg["assignment"], GroupAssignment), vector, float(msg["weight"]))
        np.save(msg["out"], result.values)
        print(json.dumps({"duration_s": time.monotonic() - started, "failed_parts": list(result.failed_parts),
                          "dropped": list(result.dropped), "bytes_sent": result.bytes_sent}), flush=True)
    await averager.close()
    await runner.cleanup()

asyncio.run(main())
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def netns_unavailable(qdisc: list[str]) -> str | None:
    """Why network namespaces with this qdisc cannot be used here, or None."""
    if not shutil.which("ip") or not shutil.which("tc"):
        return "the ip and tc commands (iproute2) are not installed"
    probe = f"ctprobe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` fails here ({made.stderr.strip()}); it needs root or CAP_SYS_ADMIN"
    try:
        q = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", *qdisc],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if q.returncode != 0:
            kind = qdisc[0]
            return (
                f"tc {kind} is not available in this kernel ({q.stderr.strip()}); load the sch_{kind} module"
            )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@contextlib.contextmanager
def bridged_namespaces(n: int):
    """``n`` namespaces, each with ``eth0`` at 10.77.0.{i+1}/24 on one bridge (in a namespace of its own)."""
    tag = secrets.token_hex(3)
    switch, names = f"ctsw-{tag}", [f"ctp{i}-{tag}" for i in range(n)]
    made: list[str] = []
    try:
        for ns in [switch, *names]:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            _ip("-n", switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", switch, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        yield names
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def set_qdisc(ns: str, spec: list[str] | None) -> None:
    if spec is None:
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True, timeout=30
        )
    else:
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", *spec],
            check=True,
            timeout=30,
        )


class NsPeer:
    def __init__(self, proc: asyncio.subprocess.Process, peer_id: str, key: SigningKey, host: str) -> None:
        self.proc, self.peer_id, self.key, self.host = proc, peer_id, key, host
        self.address = ""

    async def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def read(self) -> dict:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 90)
        if not line:
            err = await self.proc.stderr.read() if self.proc.stderr else b""
            raise AssertionError(f"peer {self.peer_id} exited: {err.decode(errors='replace')[-2000:]}")
        return json.loads(line)


def expected_mean(seeds: list[int]) -> np.ndarray:
    vectors = [np.random.default_rng(s).standard_normal(ELEMENTS).astype(np.float32) for s in seeds]
    w = np.asarray(WEIGHTS, dtype=np.float64)
    return (w[:, None] * np.stack(vectors).astype(np.float64)).sum(axis=0) / w.sum()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("link", sorted(LINKS))
async def test_allreduce_across_namespaces_over_a_degraded_link_gives_the_exact_mean(tmp_path, link):
    reason = netns_unavailable(LINKS[link])
    if reason is not None:
        pytest.skip(reason)
    tracker = SigningKey()
    with bridged_namespaces(PEERS) as names:
        for ns in names:
            set_qdisc(ns, LINKS[link])
        peers: list[NsPeer] = []
        try:
            for i, ns in enumerate(names):
                proc = await asyncio.create_subprocess_exec(
                    "ip", "netns", "exec", ns, sys.executable, "-c", PEER,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=subprocess_env(),
                )  # fmt: skip
                peer = NsPeer(proc, f"ns{i}", SigningKey(), f"10.77.0.{i + 1}")
                credential = issue_credential(tracker, RUN, peer.peer_id, peer.key.public_hex, 3600)
                await peer.send(
                    {
                        "run_id": RUN,
                        "tracker": tracker.public_hex,
                        "peer_id": peer.peer_id,
                        "key": peer.key.private_bytes().hex(),
                        "credential": encode(credential).decode(),
                        "host": peer.host,
                    }
                )
                peers.append(peer)
            for peer in peers:
                peer.address = f"{peer.host}:{(await peer.read())['port']}"

            async def one_round(r: int) -> list[dict]:
                assignment = sign_assignment(
                    tracker,
                    GroupAssignment(
                        run_id=RUN,
                        round_id=f"netem-{r}",
                        step=r,
                        members=[
                            GroupMember(
                                peer_id=p.peer_id,
                                address=p.address,
                                public_key=p.key.public_hex,
                                weight=w,
                                part=i,
                            )
                            for i, (p, w) in enumerate(zip(peers, WEIGHTS, strict=True))
                        ],
                        parts=PEERS,
                        average_params=False,
                        deadline=time.time() + 60.0,
                        seed=r,
                        signature="",
                    ),
                )
                for i, peer in enumerate(peers):
                    await peer.send(
                        {
                            "assignment": encode(assignment).decode(),
                            "seed": 1000 * r + i,
                            "n": ELEMENTS,
                            "weight": WEIGHTS[i],
                            "out": str(tmp_path / f"r{r}-p{i}.npy"),
                        }
                    )
                reports = [await p.read() for p in peers]
                expected = expected_mean([1000 * r + i for i in range(PEERS)])
                results = [np.load(tmp_path / f"r{r}-p{i}.npy") for i in range(PEERS)]
                for i, got in enumerate(results):
                    np.testing.assert_array_equal(got, results[0], err_msg=f"round {r}: peer {i} differs")
                np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-6, err_msg=f"round {r}")
                assert all(not rep["failed_parts"] and not rep["dropped"] for rep in reports), reports
                return reports

            degraded = [await one_round(r) for r in range(ROUNDS_DEGRADED)]
            for ns in names:
                set_qdisc(ns, None)
            without = await one_round(ROUNDS_DEGRADED)
        finally:
            for peer in peers:
                if peer.proc.stdin is not None:
                    peer.proc.stdin.close()
            for peer in peers:
                try:
                    await asyncio.wait_for(peer.proc.wait(), 15)
                except TimeoutError:
                    peer.proc.kill()
                    await peer.proc.wait()

    durations = [max(rep["duration_s"] for rep in reports) for reports in degraded]
    record_outcome(
        f"all-reduce across network namespaces ({link})",
        link=" ".join(LINKS[link]),
        peers=PEERS,
        elements=ELEMENTS,
        rounds_completed=len(degraded),
        exact_mean=True,
        dropped_or_failed_parts=0,
        round_s_degraded=round(float(np.median(durations)), 3),
        round_s_plain=round(max(rep["duration_s"] for rep in without), 3),
        samples_lost=0,
    )
