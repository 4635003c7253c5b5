"""A published run on loopback, for the volunteer-level tests: a real tracker, a data set cut from the
built-in corpus, a real libtorrent seeder, and a run created through the tracker's API."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.session import SessionConfig, TorrentSession
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.messages import DatasetManifest, RunSpec
from crowdtrain.publisher import build_run_create
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.volunteer import events as ev

if TYPE_CHECKING:
    from crowdtrain.volunteer.engine import Volunteer

TINY_GPT = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 32}


def closed_port() -> int:
    """A loopback port nothing listens on (bound by the OS, read back, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(
    predicate: Callable[[], bool | Awaitable[bool]],
    within_s: float,
    what: str,
    *,
    every_s: float = 0.1,
    watching: Sequence[asyncio.Task[Any]] = (),
) -> None:
    """Ask ``predicate`` (a function, or an async one) every ``every_s`` until it holds; fail naming ``what``
    after ``within_s``, or at once with the error of a task in ``watching`` that failed (a volunteer that
    could not join would otherwise show only as the wait running out)."""
    deadline = time.monotonic() + within_s
    while True:
        for task in watching:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise AssertionError(f"{what} cannot happen: {task.get_name()} failed") from task.exception()
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        await asyncio.sleep(every_s)


@dataclass
class Published:
    tracker: Any  # the running tracker: .url, .announce_url, .admin_token
    spec: RunSpec
    data_dir: Path
    manifest: DatasetManifest
    seeder: TorrentSession


@contextlib.asynccontextmanager
async def published_run(
    tmp_path: Path,
    *,
    model: dict[str, Any] | None = None,
    averaging: dict[str, Any] | None = None,
    tracker: dict[str, Any] | None = None,
    target_batch_size: int = 48,
    micro_batch_size: int = 8,
    optimizer: dict[str, Any] | None = None,
    max_bytes: int = 512 * 1024,
    chunk_bytes: int = 64 * 1024,
    seeder_rate: int = 0,
    db: str = ":memory:",
    source: str | Path = "builtin:stdlib",
    eval: dict[str, Any] | None = None,
    schedule: dict[str, Any] | None = None,
) -> AsyncIterator[Published]:
    config = TrackerConfig(**{"db": db, "heartbeat_interval_s": 0.2, "peer_ttl_s": 10.0, **(tracker or {})})
    async with serve(config) as running:
        data = tmp_path / "dataset"
        manifest = await asyncio.to_thread(
            make_dataset,
            source,
            data,
            chunk_bytes=chunk_bytes,
            name="stdlib-test",
            announce_url=running.announce_url,
            max_bytes=max_bytes,
        )
        create = await asyncio.to_thread(
            build_run_create,
            data,
            name="test-run",
            model=model or {"recipe": "tiny-gpt", "args": TINY_GPT},
            target_batch_size=target_batch_size,
            micro_batch_size=micro_batch_size,
            optimizer=optimizer or {"name": "adamw", "lr": 3e-3},
            schedule=schedule or {"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
            averaging={
                "group_size": 4,
                "codec": "none",
                "gather_s": 3.0,
                "round_timeout_s": 20.0,
                "step_timeout_s": 30.0,
                "average_state_every": 0,
                # (these runs are compared with single-process replays of the plain mean, which clip nothing;
                # the tests of clipping set it)
                "clip_multiple": 0.0,
                **(averaging or {}),
            },
            **({"eval": eval} if eval is not None else {}),
        )
        async with TrackerClient(running.url, admin_token=running.admin_token) as client:
            spec = (await client.create_run(create)).spec
        seeder = TorrentSession(SessionConfig(upload_rate_limit=seeder_rate))
        await seeder.start()
        try:
            await seeder.seed(data, (data / f"{manifest.name}.torrent").read_bytes(), manifest=manifest)
            yield Published(running, spec, data, manifest, seeder)
        finally:
            await seeder.close()


class Recorder:
    """What a volunteer's engine records for a test, given as ``Volunteer(..., record=Recorder())``:
    ``batches`` maps a step to the provenance of each micro-batch computed toward it (to replay the exact
    samples), ``params`` maps a step to the flat parameters once the steps below it were applied."""

    def __init__(self) -> None:
        self.batches: dict[int, list[list[tuple[int, int]]]] = {}
        self.params: dict[int, Any] = {}  # step -> np.ndarray (the engine's copy)

    def __call__(self, record: ev.BatchComputed | ev.ParamsAfterStep) -> None:
        if isinstance(record, ev.BatchComputed):
            self.batches.setdefault(record.step, []).append(list(record.provenance))
        else:
            self.params[record.step] = record.params


async def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m crowdtrain ARGS`` in a subprocess (not blocking the event loop), its output captured."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "crowdtrain", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def volunteers(
    run: Published,
    tmp_path: Path,
    n: int,
    *,
    seed: int = 0,
    name: str = "volunteer",
    emit: ev.Emit | Sequence[ev.Emit] = ev.no_emit,
    record: Sequence[ev.Record] | None = None,
    **config: Any,
) -> list[Volunteer]:
    """``n`` volunteers of ``run``, not started. Volunteer ``i`` keeps its data in ``tmp_path/{name}-{i}``,
    trains with the seed ``seed + i`` and the further ``VolunteerConfig`` fields ``config``, and gives its
    events to ``emit`` (``emit[i]`` when it is a sequence) and its records to ``record[i]``."""
    from crowdtrain.volunteer.config import VolunteerConfig
    from crowdtrain.volunteer.engine import Volunteer

    emits = list(emit) if isinstance(emit, Sequence) else [emit] * n
    records = [None] * n if record is None else list(record)
    return [
        Volunteer(
            VolunteerConfig(
                run_id=run.spec.run_id,
                tracker_url=run.tracker.url,
                data_dir=tmp_path / f"{name}-{i}",
                seed=seed + i,
                **config,
            ),
            emit=emits[i],
            record=records[i],
        )
        for i in range(n)
    ]
