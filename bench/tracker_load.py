"""Load on the real tracker: heartbeats (keep-alive) and announces (a connection per request, and keep-alive)
from 1k and 10k simulated peers on loopback.

The tracker runs as ``crowdtrain tracker serve`` pinned to core 0 (``taskset -c 0``); the load generator is a
separate process pinned to core 1. The generator is a lean asyncio HTTP/1.1 client (pre-built, pre-signed
requests on raw streams) so it can outrun one server core; it reports requests/s, p50/p99 latency, the server's
CPU use during each phase (≈100 % means the server, not the generator, was the limit) and requests per
second of server CPU (what one core would serve if the server had it to itself; robust to other jobs on
the machine stealing core 0, which the other figures are not). A minimal aiohttp handler per route (a
dict, no validation, no storage) is measured the same way first, as the reference.

    .venv/bin/python bench/tracker_load.py                  # 1k and 10k peers, 10 s per phase
    .venv/bin/python bench/tracker_load.py --peers 1000 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote_from_bytes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests/sim.py (make_run_create), which is not installed


def taskset(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


# ---------------------------------------------------------------- generator side


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    m = re.search(rb"(?i)content-length: *(\d+)", head)
    if m:
        await reader.readexactly(int(m.group(1)))
    else:
        await reader.read()
    return status


async def keepalive_load(
    host: str, port: int, requests: list[bytes], conns: int, seconds: float
) -> tuple[int, list[float], int]:
    latencies: list[float] = []
    bad = 0
    stop = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal bad
        reader, writer = await asyncio.open_connection(host, port)
        i = offset
        try:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                writer.write(requests[i % len(requests)])
                status = await read_response(reader)
                latencies.append(time.perf_counter() - t0)
                bad += status != 200
                i += conns
        finally:
            writer.close()

    await asyncio.gather(*(worker(k) for k in range(conns)))
    return len(latencies), latencies, bad


async def per_connection_load(
    host: str, port: int, requests: list[bytes], conns: int, seconds: float
) -> tuple[int, list[float], int]:
    latencies: list[float] = []
    bad = 0
    stop = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal bad
        i = offset
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(requests[i % len(requests)])
            status = await read_response(reader)
            writer.close()
            latencies.append(time.perf_counter() - t0)
            bad += status != 200
            i += conns

    await asyncio.gather(*(worker(k) for k in range(conns)))
    return len(latencies), latencies, bad


def summary(name: str, n: int, latencies: list[float], bad: int, seconds: float, cpu: float) -> dict:
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 100 else [float("nan")] * 99
    return {
        "phase": name,
        "requests": n,
        "req_per_s": n / seconds,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
        "errors": bad,
        "server_cpu": cpu,
    }


async def generate(
    url: str, token: str, server_pid: int, peers: int, seconds: float, conns: int
) -> list[dict]:
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.credentials import SigningKey, issue_credential
    from crowdtrain.protocol.messages import PEER_PROTOCOL, Heartbeat, JoinRequest, JoinResponse, encode
    from crowdtrain.protocol.peerauth import sign_headers, sign_session_headers
    from tests.sim import make_run_create

    host, port = url.removeprefix("http://").rsplit(":", 1)
    port_n = int(port)
    keys = [SigningKey() for _ in range(peers)]
    joined: list = [None] * peers
    join_s = 0.0
    if token == "-":  # the baseline server: same requests, signed by a throw-away "tracker" key
        run_id, fake_tracker = "baseline", SigningKey()
        for i in range(peers):
            cred = issue_credential(fake_tracker, run_id, f"{i:016x}", keys[i].public_hex, 3600)
            joined[i] = JoinResponse(
                peer_id=cred.peer_id, credential=cred, global_step=0, heartbeat_interval_s=2, peer_ttl_s=30
            )
    else:
        async with TrackerClient(url, admin_token=token, timeout_s=60) as c:
            run_id = (await c.create_run(make_run_create(f"load {peers}", target_batch_size=10**12))).run_id
            sem = asyncio.Semaphore(32)

            async def join(i: int) -> None:
                async with sem:
                    joined[i] = await c.join(
                        run_id, JoinRequest(public_key=keys[i].public_hex, peer_protocol=PEER_PROTOCOL)
                    )

            t0 = time.perf_counter()
            await asyncio.gather(*(join(i) for i in range(peers)))
            join_s = time.perf_counter() - t0

    # heartbeats: pools of pre-signed requests (valid for the tracker's 120 s clock-skew window), one with
    # the session MAC the real client uses, one with a per-request Ed25519 signature
    path = f"/api/v1/runs/{run_id}/heartbeat"
    pools: dict[str, list[bytes]] = {"mac": [], "ed25519": []}
    for i in range(min(peers, 10000)):
        body = encode(
            Heartbeat(peer_id=joined[i].peer_id, step=0, samples=random.randint(0, 50), samples_per_s=12.5)
        )
        digest = hashlib.sha256(body).hexdigest()
        cred_header = base64.urlsafe_b64encode(encode(joined[i].credential)).decode()
        session = joined[i].session_key or secrets.token_hex(32)
        for kind, headers in (
            ("mac", sign_session_headers(session, cred_header, path, digest)),
            ("ed25519", sign_headers(keys[i], joined[i].credential, "tracker", path, digest)),
        ):
            head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            head += f"Content-Length: {len(body)}\r\n\r\n"
            pools[kind].append(head.encode() + body)
    for pool in pools.values():
        random.shuffle(pool)

    info_hash = bytes.fromhex(make_run_create().dataset.infohash)
    announces = []
    for i in range(peers):
        peer_id = b"-CT0001-" + f"{i:012d}".encode()
        query = (
            f"info_hash={quote_from_bytes(info_hash, safe='')}&peer_id={quote_from_bytes(peer_id, safe='')}"
            f"&port={10000 + i % 50000}&uploaded=0&downloaded=0&left={i % 2}&compact=1&numwant=50"
        )
        announces.append(f"GET /announce?{query} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    closing = [a.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") for a in announces]
    # fill the swarm with every peer once
    reader, writer = await asyncio.open_connection(host, port_n)
    for a in announces:
        writer.write(a)
        await read_response(reader)
    writer.close()

    results = []
    for name, runner, reqs in (
        ("heartbeat (session MAC), keep-alive", keepalive_load, pools["mac"]),
        ("heartbeat (Ed25519), keep-alive", keepalive_load, pools["ed25519"]),
        ("announce, keep-alive", keepalive_load, announces),
        ("announce, connection per request", per_connection_load, closing),
    ):
        cpu0, t0 = cpu_seconds(server_pid), time.perf_counter()
        n, lat, bad = await runner(host, port_n, reqs, conns, seconds)
        elapsed = time.perf_counter() - t0
        cpu = (cpu_seconds(server_pid) - cpu0) / elapsed
        results.append(summary(name, n, lat, bad, elapsed, cpu))
    if join_s:
        results.append({"phase": "join (setup, 32 at once)", "requests": peers, "req_per_s": peers / join_s})
    return results


def baseline_server() -> None:
    """The reference point: a minimal aiohttp handler per route (a dict, no validation, no storage)."""
    from aiohttp import web

    peers: dict = {}
    swarm: dict = {}

    async def heartbeat(request: web.Request) -> web.Response:
        msg = json.loads(await request.read())
        peers[msg["peer_id"]] = msg
        return web.json_response({"global_step": 0, "samples": len(peers), "step_closed": False})

    async def announce(request: web.Request) -> web.Response:
        params = dict(p.split("=", 1) for p in request.rel_url.raw_query_string.split("&"))
        swarm[params["peer_id"]] = params["port"]
        return web.Response(body=b"d8:intervali30e5:peers" + b"300:" + bytes(300) + b"e")

    app = web.Application()
    app.router.add_post("/api/v1/runs/baseline/heartbeat", heartbeat)
    app.router.add_get("/announce", announce)

    async def run() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(f"tracker listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        print("admin token: -", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


# ---------------------------------------------------------------- orchestration


def run_one(peers: int, seconds: float, conns: int, baseline: bool) -> list[dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            *taskset(0),
            sys.executable,
            "-m",
            "crowdtrain",
            "--log-level",
            "WARNING",
            "tracker",
            "serve",
            "--port",
            "0",
            "--db",
            str(Path(tmp) / "t.sqlite3"),
            "--join-rate",
            "0",
            "--announce-rate",
            "0",
            "--peer-ttl",
            "600",
        ]
        if baseline:
            command = [*taskset(0), sys.executable, __file__, "--baseline-server"]
        launched = time.perf_counter()
        server = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            url = token = ""
            startup_s = 0.0
            assert server.stdout is not None
            while not (url and token):
                line = server.stdout.readline()
                if not line:
                    raise SystemExit("the tracker did not start")
                if m := re.match(r"tracker listening on (\S+)", line):
                    url = m.group(1)
                    startup_s = time.perf_counter() - launched
                if m := re.match(r"admin token: (\S+)", line):
                    token = m.group(1)
            gen = subprocess.run(
                [
                    *taskset(1),
                    sys.executable,
                    __file__,
                    "--generate",
                    url,
                    token,
                    str(server.pid),
                    "--peers",
                    str(peers),
                    "--seconds",
                    str(seconds),
                    "--conns",
                    str(conns),
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=seconds * 10 + 600,
            )
            if gen.returncode != 0:
                raise SystemExit(f"the load generator failed:\n{gen.stderr}")
            results = json.loads(gen.stdout.strip().splitlines()[-1])
            results.append({"phase": "start: launch -> serving (s)", "value": startup_s})
            return results
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="*", default=[1000, 10000])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--conns", type=int, default=64, help="concurrent connections of the generator")
    ap.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--generate", nargs=3, metavar=("URL", "TOKEN", "SERVER_PID"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_server:
        baseline_server()
        return
    if args.generate:
        url, token, pid = args.generate
        results = asyncio.run(generate(url, token, int(pid), args.peers[0], args.seconds, args.conns))
        print(json.dumps(results))
        return
    print(
        f"tracker pinned to core 0, generator to core 1; {args.conns} connections, {args.seconds:g} s per phase"
    )
    print(
        f"{'server':<9} {'peers':>6}  {'phase':<38} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'server CPU':>10} {'req/CPU-s':>9}"
    )
    for peers in args.peers:
        for server in ("baseline", "tracker"):
            for r in run_one(peers, args.seconds, args.conns, server == "baseline"):
                if "p50_ms" in r:
                    print(
                        f"{server:<9} {peers:>6}  {r['phase']:<38} {r['req_per_s']:>9,.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}"
                        f" {r['errors']:>6} {100 * r['server_cpu']:>9.0f}%"
                        f" {r['req_per_s'] / max(r['server_cpu'], 1e-9):>9,.0f}"
                    )
                elif "value" in r:
                    print(f"{server:<9} {peers:>6}  {r['phase']:<38} {r['value']:>9.2f}")
                else:
                    print(f"{server:<9} {peers:>6}  {r['phase']:<38} {r['req_per_s']:>9,.0f}")


if __name__ == "__main__":
    main()
