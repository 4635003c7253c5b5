"""Real processes for the fault scenarios: volunteers (``crowdtrain join --json``) and trackers
(``crowdtrain tracker serve``) started as subprocesses, their output read as they run, and SIGKILL.

Each scenario also writes what it measured (rounds completed, samples lost, time to recover) with
:func:`record_outcome`: one JSON object per line appended to the file named by ``CROWDTRAIN_RELIABILITY_OUT``
(nothing is written when it is unset). ``python bench/reliability.py`` runs the fault tests with that set and
turns the records into ``docs/reliability.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.lines import parse_json_line

OUT_ENV = "CROWDTRAIN_RELIABILITY_OUT"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 8.0


def record_outcome(scenario: str, **fields: Any) -> None:
    """Append one scenario's measured outcome to ``$CROWDTRAIN_RELIABILITY_OUT`` (if set)."""
    path = os.environ.get(OUT_ENV)
    if not path:
        return
    # "tests/test_faults_x.py::test_name[param] (call)": which test measured it, to match the JUnit report.
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    module, _, test = current.partition("::")
    where = {"module": Path(module).name, "test": test}
    line = json.dumps({"scenario": scenario, "t": time.time(), **where, **fields}, sort_keys=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def subprocess_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="120")


async def until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s until it holds; fail naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        await asyncio.sleep(0.1)


class VolunteerProcess:
    """``python -m crowdtrain join RUN --json``: every event it prints is kept in ``events``."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.events: list[ev.Event] = []
        self.stderr: list[str] = []
        self._changed = asyncio.Condition()
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._drain())]

    @classmethod
    async def start(
        cls,
        name: str,
        run_id: str,
        tracker_url: str,
        data_dir: Path,
        *,
        max_steps: int | None = None,
        extra: Sequence[str] = (),
    ) -> VolunteerProcess:
        args = [sys.executable, "-m", "crowdtrain", "join", run_id, "--tracker", tracker_url, "--json"]
        args += ["--data-dir", str(data_dir)]
        if max_steps is not None:
            args += ["--max-steps", str(max_steps)]
        proc = await asyncio.create_subprocess_exec(
            *args,
            *extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=subprocess_env(),
            start_new_session=True,
        )
        return cls(name, proc)

    async def _pump(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            try:
                event = parse_json_line(raw.decode())
            except (CrowdtrainError, ValueError):
                continue
            async with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    async def _drain(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.stderr = [*self.stderr[-40:], raw.decode(errors="replace").rstrip()]

    def of(self, kind: type[ev.Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(
        self, match: Callable[[ev.Event], bool], within_s: float, *, after: int = 0
    ) -> ev.Event:
        """The first event from index ``after`` on (seen so far or to come) for which ``match`` is true."""
        seen = after

        async def scan() -> ev.Event:
            nonlocal seen
            async with self._changed:
                while True:
                    for event in self.events[seen:]:
                        if match(event):
                            return event
                    seen = len(self.events)
                    if self._tasks[0].done():
                        raise AssertionError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
                    await self._changed.wait()

        try:
            return await asyncio.wait_for(scan(), within_s)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: no matching event within {within_s} s; {self.tail()}"
            ) from None

    def tail(self) -> str:
        return "stderr: " + " | ".join(self.stderr[-8:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def wait(self, within_s: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), within_s)
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 10)
        return code

    async def stop(self) -> None:
        """SIGINT (it leaves the run cleanly), SIGKILL after a grace period."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                self.kill()
        await self.proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class TrackerProcess:
    """``python -m crowdtrain tracker serve --db DB --port P``; ``url`` and ``admin_token`` read from its output."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.url = ""
        self.admin_token = ""
        self.port = 0
        self.lines: list[str] = []

    @classmethod
    async def start(cls, db: Path, *, port: int = 0, options: Sequence[str] = ()) -> TrackerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crowdtrain",
            "tracker",
            "serve",
            "--db",
            str(db),
            "--port",
            str(port),
            *options,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=subprocess_env(),
            start_new_session=True,
        )
        self = cls(proc)
        try:
            await asyncio.wait_for(self._read_banner(), START_TIMEOUT_S)
        except BaseException:
            self.kill()
            await proc.wait()
            raise
        self._rest = asyncio.create_task(self._drain())
        return self

    async def _read_banner(self) -> None:
        assert self.proc.stdout is not None
        while not (self.url and self.admin_token):
            raw = await self.proc.stdout.readline()
            if not raw:
                raise AssertionError(
                    "tracker exited before printing its URL: " + " | ".join(self.lines[-10:])
                )
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if m := re.search(r"listening on (http://\S+)", line):
                self.url = m.group(1).rstrip("/")
                self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
            if m := re.search(r"admin token: (\S+)", line):
                self.admin_token = m.group(1)

    async def _drain(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines = [*self.lines[-100:], raw.decode(errors="replace").rstrip()]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                self.kill()
        await self.proc.wait()
        if hasattr(self, "_rest"):
            await asyncio.wait_for(asyncio.gather(self._rest, return_exceptions=True), 10)


class SeederProcess:
    """``python -m crowdtrain dataset seed DIR --json``: the data set's seeder as a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self._rest = asyncio.create_task(self._drain())

    @classmethod
    async def start(
        cls, data_dir: Path, tracker_url: str, admin_token: str, *, upload_limit: int = 0
    ) -> SeederProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crowdtrain",
            "dataset",
            "seed",
            str(data_dir),
            "--tracker",
            tracker_url,
            "--host",
            "127.0.0.1",
            "--upload-limit",
            str(upload_limit),
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(subprocess_env(), CROWDTRAIN_ADMIN_TOKEN=admin_token),
            start_new_session=True,
        )
        assert proc.stdout is not None
        lines: list[str] = []
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while True:
                    raw = await proc.stdout.readline()
                    if not raw:
                        raise AssertionError("seeder exited before seeding: " + " | ".join(lines[-10:]))
                    lines.append(raw.decode(errors="replace").rstrip())
                    with contextlib.suppress(ValueError):
                        data = json.loads(lines[-1])
                        if isinstance(data, dict) and data.get("event") == "Seeding":
                            return cls(proc, int(data["port"]))
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise

    async def _drain(self) -> None:
        assert self.proc.stdout is not None
        async for _ in self.proc.stdout:
            pass

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        await self.proc.wait()
        await asyncio.wait_for(asyncio.gather(self._rest, return_exceptions=True), 10)


def losses_on_a_fixed_batch(
    volunteer: Any, manifest: Any, steps: Sequence[int], samples: int = 32
) -> list[float]:
    """The loss of ``volunteer``'s recorded parameters after each of ``steps`` on one fixed batch of the
    data set (the same samples for every step), computed with its own model once it has left the run."""
    from crowdtrain.datasets.sampler import Sampler

    seq_len = volunteer.spec.model.args["seq_len"]
    per_chunk = max(1, samples // len(manifest.chunks))
    provenance = [
        (c, k * seq_len)
        for c in range(len(manifest.chunks))
        for k in range(per_chunk)
        if (k + 1) * seq_len + 1 < manifest.chunks[c].samples
    ][:samples]
    batch = Sampler.take(provenance, manifest, volunteer.config.data_dir, seq_len)
    out = []
    for step in steps:
        volunteer.trainer.set_flat_params(volunteer.param_history[step])
        out.append(volunteer.trainer.evaluate(batch.x, batch.y))
    return out
