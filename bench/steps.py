"""Full steps against the real tracker: what one step costs it per volunteer, at 100, 300 and 1,000.

Light simulated volunteers drive whole collaborative steps the way ``crowdtrain join`` does (the engine's
tracker link, volunteer/link.py, without a model): each one computes toward its allotment of the step at its
own rate (a clock, no gradients); its heartbeat loop sends a heartbeat every heartbeat interval (2 s), or at
once when poked; it pokes one when it reaches its allotment (the report that closes the step) and when a
step begins without an allotment (the first step; later ones get theirs in the ready reply). At its allotment
it asks nothing: one long-poll per volunteer (``GET /step``) answers when the step closes, or when samples of
it were freed (then it heartbeats for a share of them; a steady run frees none). On the close (from the
watch, or a heartbeat's reply if that came first) it calls ``ready`` with its weight, gets its signed
assignment and the next step's allotment, and moves on. Three keep-alive connections per volunteer, as the
engine's connection pool has: heartbeats, the watch, ready calls. Each volunteer answers the tracker's
reachability check (``GET /v1/ping``) on its own port, so every one may own a part. ``--heartbeats few``
drops the heartbeats at the interval: only those a step cannot do without (at the allotment). (The engine
heartbeats every 0.25 s while the run's rate is unknown: never here, every volunteer reports its rate.)

The tracker runs as ``crowdtrain tracker serve`` pinned to core 0 (``taskset -c 0``); the volunteers run in
one generator process pinned to core 1 (uvloop, raw keep-alive HTTP/1.1 connections, requests signed with the session MAC the real client uses). Steps are measured one at a time (every
volunteer has its assignment before the next step starts): the tracker's CPU time per step (utime + stime
from /proc), per 100 volunteers, and its growth against the first ``--peers`` figure (cost per step per
volunteer at N ÷ at the first N; 1.0 is linear); the ready latency after the close (from the first reply
anyone got saying the step closed to each volunteer's assignment). The tracker's garbage collector is timed
apart over the same steps (gc.callbacks in the tracker's process): cProfile charges its time to whatever
function allocated when it ran. The generator's own CPU share is printed too: well below 100 % means it
was not the limit. ``--repeat`` runs each count several times, round-robin, and shows the median: other
jobs on the machine only ever add CPU time.

    .venv/bin/python bench/steps.py                              # 100, 300, 1000 volunteers
    .venv/bin/python bench/steps.py --peers 100 --steps 2        # quick
    .venv/bin/python bench/steps.py --tracker-path DIR           # a tracker exported elsewhere (DIR/crowdtrain)
    .venv/bin/python bench/steps.py --profile DIR                # cProfile of the measured steps, DIR/tracker-N.prof
    .venv/bin/python bench/steps.py --heartbeats few --repeat 3  # the bare step, median of 3 runs each
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter as collections_counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WATCH_S = 20.0  # volunteer/link.py: the long-poll for a step's close
READY_WAIT_S = 20.0
CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")


def taskset(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---------------------------------------------------------------- tracker process


def tracker_process(gc_stats: str, profile: str | None, serve_args: list[str]) -> None:
    """``crowdtrain tracker serve`` in this process, from whatever ``crowdtrain`` is first on the path (the
    orchestrator puts ``--tracker-path`` there). From SIGUSR1 to SIGUSR2 (the measured steps) it times the
    garbage collector (whose time cProfile gives to whatever function allocated when it ran) and writes
    that to ``gc_stats``; with ``profile``, cProfile runs over the same steps and its profile is written
    there."""
    import crowdtrain.tracker

    print(f"tracker code: {Path(crowdtrain.tracker.__file__).parent}", flush=True)
    import cProfile

    profiler = cProfile.Profile() if profile else None
    collections: dict[int, list[float]] = {0: [], 1: [], 2: []}
    began: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[:] = [time.thread_time()]
        elif began:
            collections[info["generation"]].append(time.thread_time() - began[0])

    def start(signum: int, frame: object) -> None:
        gc.callbacks.append(on_gc)
        if profiler is not None:
            profiler.enable()

    def stop(signum: int, frame: object) -> None:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        gc.callbacks.remove(on_gc)
        stats = {str(g): {"count": len(t), "seconds": sum(t)} for g, t in collections.items()}
        tracked = gc.get_objects()
        kinds = collections_counter(type(o).__qualname__ for o in tracked).most_common(12)
        Path(gc_stats).write_text(json.dumps({"collections": stats, "tracked": len(tracked), "kinds": kinds}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from crowdtrain.cli import main

    main(["--log-level", "WARNING", "tracker", "serve", *serve_args])


# ---------------------------------------------------------------- generator side


class Link:
    """One keep-alive HTTP/1.1 connection to the tracker, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def call(self, raw: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        m = CONTENT_LENGTH.search(head)
        body = await self.reader.readexactly(int(m.group(1))) if m else b""
        return int(head[9:12]), body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Counts:
    def __init__(self) -> None:
        self.heartbeat = self.watch = self.ready = self.freed = 0


class Sim:
    """What the volunteers share: the run, the close of each step as they heard it, request counts."""

    def __init__(self, host: str, port: int, run_id: str, few: bool) -> None:
        import msgspec

        from crowdtrain.protocol.messages import HeartbeatReply, ReadyReply, StepWatch

        self.host, self.port, self.run_id = host, port, run_id
        # (replies decoded without the client's checks: the tracker under test is trusted, the generator lean)
        self.decoders = {
            "heartbeat": msgspec.json.Decoder(HeartbeatReply),
            "ready": msgspec.json.Decoder(ReadyReply),
            "watch": msgspec.json.Decoder(StepWatch),
        }
        self.interval_s = 2.0  # the heartbeat interval, as the tracker says at join
        self.few = few  # no heartbeats at the interval
        self.closed_at: dict[int, float] = {}
        self.counts = Counts()

    def heard(self, step: int, global_step: int, closed: bool) -> bool:
        """A reply about ``step``: whether it says the step closed (the first such reply is the close)."""
        if global_step > step or (global_step == step and closed):
            self.closed_at.setdefault(step, time.perf_counter())
            return True
        return False


class SimPeer:
    """One light volunteer: its credential and session key, its rate, its connections, its ping port, and
    the engine's view of the run (volunteer/link.py): its step, its allotment, the tracker's newest word."""

    def __init__(self, sim: Sim, joined, rate: float, ping_port: int) -> None:
        from crowdtrain.protocol.messages import encode

        self.sim = sim
        self.peer_id = joined.peer_id
        self.session_key = joined.session_key
        self.cred_header = base64.urlsafe_b64encode(encode(joined.credential)).decode()
        self.rate = rate
        self.address = f":{ping_port}"
        self.control = Link(sim.host, sim.port)  # heartbeats
        self.watcher = Link(sim.host, sim.port)  # the step watch
        self.readier = Link(sim.host, sim.port)  # ready calls
        self.pos = 0  # the step it computes for
        self.samples = 0.0  # computed toward it, as of ``since``
        self.since = 0.0  # (loop time)
        self.allot: tuple[int, int] | None = None  # (step, samples): its allotment, as last heard
        self.news: tuple[int, bool] | None = None  # (global step, closed): the tracker's newest word
        self.freed = False  # the watch said samples of the step were freed
        self.changed = asyncio.Event()  # a reply came
        self.poked = asyncio.Event()  # heartbeat now

    def _post(self, action: str, msg, query: str = "") -> bytes:
        from crowdtrain.protocol.messages import encode
        from crowdtrain.protocol.peerauth import sign_session_headers

        path = f"/api/v1/runs/{self.sim.run_id}/{action}"
        body = encode(msg)
        headers = sign_session_headers(
            self.session_key, self.cred_header, path, hashlib.sha256(body).hexdigest()
        )
        head = (
            f"POST {path}{query} HTTP/1.1\r\nHost: {self.sim.host}:{self.sim.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        return head.encode() + body

    async def _call(self, link: Link, raw: bytes, decoder):
        status, body = await link.call(raw)
        if status != 200:
            raise RuntimeError(f"peer {self.peer_id}: the tracker answered {status}: {body[:300]!r}")
        return decoder.decode(body)

    async def heartbeat(self, step: int, samples: int):
        from crowdtrain.protocol.messages import Heartbeat

        self.sim.counts.heartbeat += 1
        hb = Heartbeat(
            peer_id=self.peer_id, step=step, samples=samples, samples_per_s=self.rate, address=self.address
        )
        return await self._call(self.control, self._post("heartbeat", hb), self.sim.decoders["heartbeat"])

    async def ready(self, step: int, weight: int):
        from crowdtrain.protocol.messages import ReadyRequest

        self.sim.counts.ready += 1
        msg = ReadyRequest(peer_id=self.peer_id, step=step, weight=weight)
        raw = self._post("ready", msg, f"?wait_s={READY_WAIT_S:g}")
        return await self._call(self.readier, raw, self.sim.decoders["ready"])

    # ------------------------------------------------------------ the engine's link, modelled

    def computed(self) -> float:
        """Samples computed toward the current step by now: at its rate, up to its allotment (none
        without one)."""
        allot = self.allot[1] if self.allot is not None and self.allot[0] == self.pos else None
        now = asyncio.get_running_loop().time()
        if allot is not None and self.samples < allot:
            self.samples = min(float(allot), self.samples + self.rate * (now - self.since))
        self.since = now
        return self.samples

    def hear(self, global_step: int, closed: bool) -> None:
        """TrackerLink._hear: the newest word, unless older than the one kept."""
        self.sim.heard(self.pos, global_step, closed)
        if self.news is None or (global_step, closed) >= self.news:
            self.news = (global_step, closed)
        self.changed.set()

    async def beat(self) -> None:
        """TrackerLink.heartbeats: every interval, or at once when poked (the reply: allotment and news)."""
        interval = math.inf if self.sim.few else self.sim.interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if math.isinf(interval) else interval):
                    await self.poked.wait()
            self.poked.clear()
            step = self.pos
            self.freed = False
            reply = await self.heartbeat(step, int(self.computed()))
            if reply.global_step == step == self.pos and reply.allotment is not None:
                self.computed()  # (at the old allotment up to now)
                self.allot = (step, reply.allotment)
            self.hear(reply.global_step, reply.step_closed)

    async def watch(self, step: int) -> None:
        """TrackerLink.watch: long-polls ``step`` until it closed (or passed); a reply saying samples of it
        were freed makes the volunteer ask for a share, if it is at its allotment."""
        path = f"/api/v1/runs/{self.sim.run_id}/step?step={step}&wait_s={WATCH_S:g}"
        raw = f"GET {path} HTTP/1.1\r\nHost: {self.sim.host}:{self.sim.port}\r\n\r\n".encode()
        while True:
            self.sim.counts.watch += 1
            w = await self._call(self.watcher, raw, self.sim.decoders["watch"])
            if w.global_step > step or w.step_closed:
                self.hear(w.global_step, w.step_closed)
                return
            if w.free:
                self.sim.counts.freed += 1
                self.freed = True
                self.changed.set()

    async def step(self, step: int) -> float:
        """One full step (the training loop's turns and its follow, volunteer/loop.py); returns when this volunteer had its assignment
        (perf_counter)."""
        watch = asyncio.get_running_loop().create_task(self.watch(step))
        if self.allot is None or self.allot[0] != step:
            self.poked.set()  # no allotment of this step came with the last group: ask for one
        at_quota = False
        while not (self.news is not None and (self.news[0] > step or self.news == (step, True))):
            samples = self.computed()
            allot = self.allot[1] if self.allot is not None and self.allot[0] == step else None
            self.changed.clear()
            if allot is not None and samples < allot:
                at_quota = False
                with contextlib.suppress(TimeoutError):  # computing, until its allotment or a reply
                    async with asyncio.timeout((allot - samples) / self.rate):
                        await self.changed.wait()
                continue
            if allot is not None and not at_quota:
                at_quota = True
                self.poked.set()  # report it: the report of the last one closes the step
            await self.changed.wait()  # the close (watch or heartbeat), an allotment, or freed samples
            if self.freed and at_quota:
                self.freed = False
                self.poked.set()
        if self.news[0] > step:
            raise RuntimeError(f"peer {self.peer_id} missed step {step}")
        while True:
            answer = await self.ready(step, int(self.computed()))
            if answer.status == "group":
                done = time.perf_counter()
                break
            if answer.status != "wait":
                raise RuntimeError(f"peer {self.peer_id}: ready for step {step} answered {answer.status}")
        if answer.next_allotment is not None and answer.global_step == step + 1:
            self.allot = (step + 1, answer.next_allotment)
        # on to the next step, computing at once (between two measured steps too, as the engine would)
        self.pos, self.samples, self.since = step + 1, 0.0, asyncio.get_running_loop().time()
        self.news = None  # (wait for a fresh word on the new step)
        await asyncio.wait_for(watch, WATCH_S + 10)
        return done


async def ping_server(peer_id_of: dict[int, str]) -> tuple[asyncio.AbstractServer, int]:
    """A peer server answering ``GET /v1/ping`` with the peer id of its port (filled in after join)."""
    port_box: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            body = json.dumps({"peer_id": peer_id_of.get(port_box[0], "")}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port_box.append(server.sockets[0].getsockname()[1])
    return server, port_box[0]


async def generate(args: argparse.Namespace, url: str, token: str, tracker_pid: int) -> dict:
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.credentials import SigningKey
    from crowdtrain.protocol.messages import PEER_PROTOCOL, JoinRequest
    from tests.sim import make_run_create

    n = args.peers[0]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    rng = random.Random(n)
    setup_t0 = time.perf_counter()
    async with TrackerClient(url, admin_token=token, timeout_s=60) as c:
        created = await c.create_run(make_run_create(f"steps {n}", target_batch_size=args.per_peer * n))
        sim = Sim(host, int(port), created.run_id, args.heartbeats == "few")
        ping_ids: dict[int, str] = {}
        servers = [await ping_server(ping_ids) for _ in range(n)]
        sem = asyncio.Semaphore(32)

        async def join(i: int) -> SimPeer:
            _, ping_port = servers[i]
            async with sem:
                joined = await c.join(
                    created.run_id,
                    JoinRequest(
                        public_key=SigningKey().public_hex,
                        address=f":{ping_port}",
                        peer_protocol=PEER_PROTOCOL,
                    ),
                )
            sim.interval_s = joined.heartbeat_interval_s
            ping_ids[ping_port] = joined.peer_id
            # a rate that computes its share of a step in compute_s × 0.5…1
            rate = args.per_peer / (args.compute_s * rng.uniform(0.5, 1.0))
            return SimPeer(sim, joined, rate, ping_port)

        peers = await asyncio.gather(*(join(i) for i in range(n)))

    async def connect(p: SimPeer) -> None:
        async with sem:
            await p.control.open()
            await p.watcher.open()
            await p.readier.open()

    await asyncio.gather(*(connect(p) for p in peers))
    # every volunteer reachable before the first step (the tracker pings each one once)
    deadline = time.perf_counter() + 60
    waiting = list(peers)
    while waiting:
        replies = await asyncio.gather(*(p.heartbeat(0, 0) for p in waiting))
        for p, r in zip(waiting, replies, strict=True):
            p.allot = (
                (0, r.allotment) if r.allotment is not None else None
            )  # (as the engine's first heartbeat)
        waiting = [p for p, r in zip(waiting, replies, strict=True) if not r.reachable]
        if waiting and time.perf_counter() > deadline:
            raise RuntimeError(f"{len(waiting)} volunteers were not found reachable within 60 s")
        if waiting:
            await asyncio.sleep(0.05)
    setup_s = time.perf_counter() - setup_t0
    loop = asyncio.get_running_loop()
    for p in peers:
        p.since = loop.time()
    beats = [loop.create_task(p.beat()) for p in peers]  # each volunteer's heartbeat loop, all along

    records = []
    total = args.warmup + args.steps
    for step in range(total):
        measured = step >= args.warmup
        if step == args.warmup:  # the tracker times its GC (and profiles) over the measured steps
            os.kill(tracker_pid, signal.SIGUSR1)
        before = (sim.counts.heartbeat, sim.counts.watch, sim.counts.ready, sim.counts.freed)
        cpu0, gen0, t0 = cpu_seconds(tracker_pid), time.process_time(), time.perf_counter()
        done = await asyncio.gather(*(p.step(step) for p in peers))
        cpu1, gen1, t1 = cpu_seconds(tracker_pid), time.process_time(), time.perf_counter()
        for beat in beats:  # (a heartbeat loop that failed would leave its volunteer waiting)
            if beat.done():
                beat.result()
        closed = sim.closed_at[step]
        records.append(
            {
                "step": step,
                "measured": measured,
                "tracker_cpu_s": cpu1 - cpu0,
                "generator_cpu_s": gen1 - gen0,
                "wall_s": t1 - t0,
                "close_s": closed - t0,
                "latency_ms": [round(1000 * (d - closed), 2) for d in done],
                "heartbeats": sim.counts.heartbeat - before[0],
                "watches": sim.counts.watch - before[1],
                "readies": sim.counts.ready - before[2],
                "freed": sim.counts.freed - before[3],
            }
        )
        if step == total - 1:
            os.kill(tracker_pid, signal.SIGUSR2)
    for beat in beats:
        beat.cancel()
    await asyncio.gather(*beats, return_exceptions=True)
    for p in peers:
        p.control.close()
        p.watcher.close()
        p.readier.close()
    for server, _ in servers:
        server.close()
    return {"peers": n, "setup_s": setup_s, "steps": records}


# ---------------------------------------------------------------- orchestration


def raise_file_limit() -> None:
    """Three connections per volunteer on each side, and a ping port each: lift the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_one(peers: int, args: argparse.Namespace, turn: int = 0) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.tracker_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(args.tracker_path).resolve()), *filter(None, [env.get("PYTHONPATH")])]
        )
    with tempfile.TemporaryDirectory() as tmp:
        name = f"tracker-{peers}.prof" if not turn else f"tracker-{peers}-{turn}.prof"
        profile = str(Path(args.profile).resolve() / name) if args.profile else ""
        command = [
            *taskset(0),
            sys.executable,
            str(Path(__file__).resolve()),
            "--tracker-process",
            str(Path(tmp) / "gc.json"),
            profile,
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
        # (run from the temporary folder: the repository's crowdtrain/ folder must not shadow --tracker-path)
        server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
        try:
            url = token = code = ""
            assert server.stdout is not None
            while not (url and token):
                line = server.stdout.readline()
                if not line:
                    raise SystemExit("the tracker did not start")
                if m := re.match(r"tracker code: (\S+)", line):
                    code = m.group(1)
                if m := re.match(r"tracker listening on (\S+)", line):
                    url = m.group(1)
                if m := re.match(r"admin token: (\S+)", line):
                    token = m.group(1)
            gen_args = [
                "--generate",
                url,
                str(server.pid),
                str(Path(tmp) / "steps.json"),
                "--peers",
                str(peers),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--per-peer",
                str(args.per_peer),
                "--compute-s",
                str(args.compute_s),
                "--heartbeats",
                args.heartbeats,
            ]
            gen = subprocess.run(
                [*taskset(1), sys.executable, str(Path(__file__).resolve()), *gen_args],
                capture_output=True,
                text=True,
                # (the token in the environment: one that begins with "-" read as an option)
                env=dict(os.environ, PYTHONUNBUFFERED="1", BENCH_ADMIN_TOKEN=token),
                timeout=900,
            )
            if gen.returncode != 0:
                raise SystemExit(f"the generator failed:\n{gen.stderr[-4000:]}")
            result = json.loads((Path(tmp) / "steps.json").read_text())
            gc_file = Path(tmp) / "gc.json"
            deadline = time.monotonic() + 30
            while not gc_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # (written by the tracker's signal handler: let it finish)
            result["gc"] = json.loads(gc_file.read_text())
            result["code"] = code
            return result
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def summarize(results: list[dict]) -> dict:
    """One row per volunteer count: CPU and GC per step are medians over the repeats of each run's mean
    (other jobs on the machine only ever add to them), the rest pooled over every measured step."""
    steps = [r for result in results for r in result["steps"] if r["measured"]]
    n = results[0]["peers"]

    def per_step_ms(result: dict) -> tuple[float, float]:
        measured = [r for r in result["steps"] if r["measured"]]
        gc_s = sum(g["seconds"] for g in result["gc"]["collections"].values())
        return 1000 * sum(r["tracker_cpu_s"] for r in measured) / len(measured), 1000 * gc_s / len(measured)

    cpu_ms = statistics.median(per_step_ms(result)[0] for result in results)
    gc_ms = statistics.median(per_step_ms(result)[1] for result in results)
    latencies = [ms for r in steps for ms in r["latency_ms"]]
    wall = sum(r["wall_s"] for r in steps)
    return {
        "peers": n,
        "cpu_ms": cpu_ms,
        "gc_ms": gc_ms,
        "cpu_ms_min": 1000 * min(r["tracker_cpu_s"] for r in steps),
        "per100_ms": cpu_ms * 100 / n,
        "hb_per_peer": sum(r["heartbeats"] for r in steps) / len(steps) / n,
        "req_per_peer": sum(r["heartbeats"] + r["watches"] + r["readies"] for r in steps) / len(steps) / n,
        "p50_ms": quantile(latencies, 0.50),
        "p99_ms": quantile(latencies, 0.99),
        "wall_s": wall / len(steps),
        "tracker_busy": sum(r["tracker_cpu_s"] for r in steps) / wall,
        "generator_busy": sum(r["generator_cpu_s"] for r in steps) / wall,
    }


def main() -> None:
    if sys.argv[1:2] == ["--tracker-process"]:  # the tracker's own process: GC_STATS PROFILE, serve's options
        tracker_process(sys.argv[2], sys.argv[3] or None, sys.argv[4:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="*", default=[100, 300, 1000])
    ap.add_argument("--steps", type=int, default=5, help="measured steps per volunteer count")
    ap.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps before the measured ones (the tracker keeps its last 8 formed steps' assignments: until"
        " it holds 8, each step adds ~6 objects per volunteer to its heap, and the collector runs on them)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per volunteer count (the median is shown)")
    ap.add_argument("--per-peer", type=int, default=64, help="the target is this many samples per volunteer")
    ap.add_argument(
        "--compute-s", type=float, default=2.0, help="a volunteer computes its share in 0.5…1 × this"
    )
    ap.add_argument(
        "--heartbeats",
        choices=("engine", "few"),
        default="engine",
        help="engine: the volunteer engine's cadence; few: at the start, at the allotment, after the close",
    )
    ap.add_argument(
        "--tracker-path", help="put this folder first on the tracker's PYTHONPATH (DIR/crowdtrain)"
    )
    ap.add_argument("--profile", help="write a cProfile of the tracker's measured steps here, one per N")
    ap.add_argument("--json", action="store_true", help="print the raw per-step records too")
    ap.add_argument("--generate", nargs=3, metavar=("URL", "PID", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    raise_file_limit()
    if args.generate:
        sys.path.insert(0, str(ROOT))  # for tests/sim.py (make_run_create), which is not installed
        import uvloop

        (url, pid, out), token = args.generate, os.environ["BENCH_ADMIN_TOKEN"]
        Path(out).write_text(json.dumps(uvloop.run(generate(args, url, token, int(pid)))))
        return
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results: dict[int, list[dict]] = {n: [] for n in args.peers}
    for turn in range(args.repeat):  # round-robin, so a busy spell on the machine spreads over every N
        for peers in args.peers:
            result = run_one(peers, args, turn)
            if args.json:
                print(json.dumps(result))
            results[peers].append(result)
            cpu = statistics.mean(r["tracker_cpu_s"] for r in result["steps"] if r["measured"])
            measured = sum(r["measured"] for r in result["steps"])
            by_generation = ", ".join(
                f"gen {g} {c['count'] / measured:.1f}× {1000 * c['seconds'] / measured:.1f} ms"
                for g, c in result["gc"]["collections"].items()
            )
            print(
                f"({peers} volunteers: tracker code from {result['code']}, setup {result['setup_s']:.1f} s,"
                f" tracker CPU {1000 * cpu:.0f} ms per step; GC per step: {by_generation};"
                f" {result['gc']['tracked']:,} objects tracked)"
            )
    rows = [summarize(results[n]) for n in args.peers]
    base = rows[0]
    print(
        f"tracker pinned to core 0, volunteers to core 1; {args.warmup} warm-up + {args.steps} measured steps "
        f"each, median of {args.repeat} runs; target {args.per_peer} samples per volunteer; heartbeats: {args.heartbeats}"
        + ("; PROFILED (cProfile inflates the CPU figures)" if args.profile else "")
    )
    print(
        f"{'peers':>6} {'CPU ms/step':>11} {'(min)':>7} {'ms/step/100':>11} {'growth':>6} {'GC ms/step':>10}"
        f" {'hb/peer':>7}"
        f" {'req/peer':>8} {'ready p50':>9} {'p99 ms':>7} {'step s':>6} {'tracker':>7} {'gen':>5}"
    )
    for r in rows:
        growth = (r["cpu_ms"] / r["peers"]) / (base["cpu_ms"] / base["peers"])
        print(
            f"{r['peers']:>6} {r['cpu_ms']:>11.1f} {r['cpu_ms_min']:>7.1f} {r['per100_ms']:>11.1f}"
            f" {growth:>5.2f}x {r['gc_ms']:>10.1f} {r['hb_per_peer']:>7.1f} {r['req_per_peer']:>8.1f} {r['p50_ms']:>9.0f}"
            f" {r['p99_ms']:>7.0f} {r['wall_s']:>6.2f} {100 * r['tracker_busy']:>6.0f}%"
            f" {100 * r['generator_busy']:>4.0f}%"
        )
    print(
        "growth: CPU per step per volunteer ÷ the same at the first N (1.00 = linear); ready p50/p99: from the "
        "close to each assignment; tracker/gen: CPU share during the steps (gen well below 100 %: not the limit)"
    )


if __name__ == "__main__":
    main()
