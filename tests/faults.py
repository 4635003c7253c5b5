"""Real processes for the fault scenarios: volunteers (``crowdtrain join --json``), trackers
(``crowdtrain tracker serve``) and seeders (``crowdtrain dataset seed``) started as subprocesses, their output
read as they run, and SIGKILL. Starting, reading and stopping them is :class:`crowdtrain.procs.Child`, the
helper ``crowdtrain demo`` starts its volunteers with; this module adds what each scenario reads from them.

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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from crowdtrain.procs import Child, child_env, json_events
from crowdtrain.volunteer import events as ev

OUT_ENV = "CROWDTRAIN_RELIABILITY_OUT"
START_TIMEOUT_S = 60.0


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
    return child_env(COLUMNS="120")


class VolunteerProcess:
    """``python -m crowdtrain join RUN --json``: every event it prints is kept in ``events``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[ev.Event] = []
        self.child: Child

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
        args = ["join", run_id, "--tracker", tracker_url, "--json", "--data-dir", str(data_dir)]
        if max_steps is not None:
            args += ["--max-steps", str(max_steps)]
        self = cls(name)
        self.child = await Child.start(
            [*args, *extra], name=name, on_line=json_events(self.events.append), env=subprocess_env()
        )
        return self

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.child.proc

    def of(self, kind: type[ev.Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(
        self, match: Callable[[ev.Event], bool], within_s: float, *, after: int = 0
    ) -> ev.Event:
        """The first event from index ``after`` on (seen so far or to come) for which ``match`` is true."""
        seen = after
        found: list[ev.Event] = []

        def scan() -> bool:
            nonlocal seen
            for event in self.events[seen:]:
                if match(event):
                    found.append(event)
                    return True
            seen = len(self.events)
            return False

        try:
            await self.child.until(scan, within_s)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: no matching event within {within_s} s; {self.tail()}"
            ) from None
        except EOFError:
            raise AssertionError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}") from None
        return found[0]

    def tail(self) -> str:
        return "stderr: " + " | ".join(self.child.tail(8))

    def kill(self) -> None:
        self.child.kill()

    async def wait(self, within_s: float) -> int:
        return await self.child.wait(within_s)

    async def stop(self) -> None:
        """SIGINT (it leaves the run cleanly), SIGKILL after a grace period."""
        await self.child.stop()


class TrackerProcess:
    """``python -m crowdtrain tracker serve --db DB --port P``; ``url`` and ``admin_token`` read from its output."""

    def __init__(self) -> None:
        self.url = ""
        self.admin_token = ""
        self.port = 0
        self.child: Child

    @classmethod
    async def start(cls, db: Path | str, *, port: int = 0, options: Sequence[str] = ()) -> TrackerProcess:
        self = cls()
        self.child = await Child.start(
            ["tracker", "serve", "--db", str(db), "--port", str(port), *options],
            name="tracker",
            on_line=self._read_banner,
            merge_stderr=True,
            env=subprocess_env(),
            keep=101,
        )
        await _started(self.child, lambda: bool(self.url and self.admin_token), "printing its URL")
        return self

    def _read_banner(self, line: str) -> None:
        if self.url and self.admin_token:
            return
        if m := re.search(r"listening on (http://\S+)", line):
            self.url = m.group(1).rstrip("/")
            self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        if m := re.search(r"admin token: (\S+)", line):
            self.admin_token = m.group(1)

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.child.proc

    @property
    def lines(self) -> list[str]:
        return list(self.child.lines)

    def kill(self) -> None:
        self.child.kill()

    async def close(self) -> None:
        await self.child.stop()


class SeederProcess:
    """``python -m crowdtrain dataset seed DIR --json``: the data set's seeder as a process of its own."""

    def __init__(self) -> None:
        self.port = 0
        self.seeding = False
        self.child: Child

    @classmethod
    async def start(
        cls, data_dir: Path, tracker_url: str, admin_token: str, *, upload_limit: int = 0
    ) -> SeederProcess:
        self = cls()
        args = ["dataset", "seed", str(data_dir), "--tracker", tracker_url, "--host", "127.0.0.1"]
        self.child = await Child.start(
            [*args, "--upload-limit", str(upload_limit), "--json"],
            name="seeder",
            on_line=self._read_seeding,
            merge_stderr=True,
            env=dict(subprocess_env(), CROWDTRAIN_ADMIN_TOKEN=admin_token),
        )
        await _started(self.child, lambda: self.seeding, "seeding")
        return self

    def _read_seeding(self, line: str) -> None:
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if not self.seeding and isinstance(data, dict) and data.get("event") == "Seeding":
                self.port, self.seeding = int(data["port"]), True

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.child.proc

    def kill(self) -> None:
        self.child.kill()

    async def close(self) -> None:
        await self.child.stop(grace_s=0)


async def _started(child: Child, ready: Callable[[], bool], what: str) -> None:
    """Wait until ``ready()`` (read from ``child``'s output); SIGKILL it if that fails."""
    try:
        await child.until(ready, START_TIMEOUT_S)
    except EOFError:
        await child.stop(grace_s=0)
        raise AssertionError(f"{child.name} exited before {what}: " + " | ".join(child.tail(10))) from None
    except BaseException:
        await child.stop(grace_s=0)
        raise


def losses_on_a_fixed_batch(
    volunteer: Any, params: Mapping[int, Any], manifest: Any, steps: Sequence[int], samples: int = 32
) -> list[float]:
    """The loss of ``volunteer``'s recorded parameters (``params``: step -> flat parameters, as a
    ``Recorder`` keeps them) after each of ``steps`` on one fixed batch of the data set (the same samples
    for every step), computed with its own model once it has left the run."""
    from crowdtrain.datasets.sampler import Sampler
    from tests.oracles import mean_loss  # torch: only for the tests that measure a loss

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
        volunteer.trainer.set_flat_params(params[step])
        out.append(mean_loss(volunteer.trainer, batch.x, batch.y))
    return out
