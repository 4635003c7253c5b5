"""Child processes of our own command: ``python -m crowdtrain ARGS`` in a session of its own, its output
read line by line while it runs, stopped with SIGINT and then SIGKILL.

``crowdtrain demo`` starts its volunteers this way, and the fault tests their volunteers, trackers and
seeders (``tests/faults.py``). A child runs in a new session, so Ctrl-C in the terminal reaches only the
parent, which stops its children itself: SIGINT first (a volunteer leaves its run, a tracker closes its
database), SIGKILL for whatever is still running after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crowdtrain.volunteer import events as ev

STOP_GRACE_S = 8.0  # from SIGINT to SIGKILL
DRAIN_S = 10.0  # once a child has exited, how long its output may take to reach its end

LineHandler = Callable[[str], None]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: one torch thread, unbuffered output, and ``extra`` (which may
    set another ``OMP_NUM_THREADS``)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def json_events(handle: Callable[[ev.Event], None], skipped: LineHandler | None = None) -> LineHandler:
    """A line handler for ``--json`` output: each line that is a volunteer event goes to ``handle``; any
    other line (a library's warning, a line cut short by SIGKILL) is skipped, and given to ``skipped``."""
    from crowdtrain.protocol.errors import CrowdtrainError
    from crowdtrain.volunteer.view.lines import parse_json_line

    def on_line(line: str) -> None:
        try:
            event = parse_json_line(line)
        except (CrowdtrainError, ValueError):
            if skipped is not None:
                skipped(line)
            return
        handle(event)

    return on_line


async def stop_processes(procs: Iterable[asyncio.subprocess.Process], grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT each process still running, then SIGKILL those still there ``grace_s`` later (at once when
    ``grace_s`` is 0); returns when all have exited."""
    running = [proc for proc in procs if proc.returncode is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT if grace_s > 0 else signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    for proc in running:
        try:
            async with asyncio.timeout(max(0.1, deadline - loop.time())):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class Child:
    """One ``python -m crowdtrain ARGS`` process, started with :meth:`start`.

    Each line it prints on stdout goes to ``on_line`` as soon as it is read; the last ``keep`` lines of its
    stderr (of all its output with ``merge_stderr``) stay in ``lines`` for :meth:`tail`. The output is read
    by tasks in ``tg`` when one is given, so a failure of ``on_line`` is that group's; otherwise by tasks of
    the child's own, whose failure :meth:`wait` and :meth:`stop` raise.
    """

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        on_line: LineHandler | None,
        keep: int,
        tg: asyncio.TaskGroup | None,
    ) -> None:
        self.name = name
        self.proc = proc
        self.lines: deque[str] = deque(maxlen=keep)
        self._on_line = on_line
        self._news = asyncio.Event()  # set after each stdout line and at its end
        self._stdout_closed = False
        self._own_readers = tg is None
        spawn = asyncio.create_task if tg is None else tg.create_task
        self._readers = [spawn(self._read_stdout(), name=f"{name} stdout")]
        if proc.stderr is not None:
            self._readers.append(spawn(self._read_stderr(proc.stderr), name=f"{name} stderr"))

    @classmethod
    async def start(
        cls,
        args: Sequence[str],
        *,
        name: str = "crowdtrain",
        on_line: LineHandler | None = None,
        merge_stderr: bool = False,
        env: Mapping[str, str] | None = None,
        keep: int = 40,
        tg: asyncio.TaskGroup | None = None,
    ) -> Child:
        """Start ``python -m crowdtrain *args`` with ``env`` (:func:`child_env` when None)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crowdtrain",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
            env=child_env() if env is None else dict(env),
            start_new_session=True,  # Ctrl-C reaches the parent only; it stops the child itself
        )
        try:
            return cls(name, proc, on_line, keep, tg)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        merged = self.proc.stderr is None
        try:
            async for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                if merged:
                    self.lines.append(line)
                if self._on_line is not None:
                    self._on_line(line)
                self._news.set()
        finally:
            self._stdout_closed = True
            self._news.set()

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self.lines.append(raw.decode(errors="replace").rstrip())

    async def until(self, predicate: Callable[[], bool], within_s: float) -> None:
        """Return once ``predicate()`` holds, asking again after each line read. Raises ``TimeoutError``
        after ``within_s`` and ``EOFError`` when its output ends first (it exited)."""
        async with asyncio.timeout(within_s):
            while not predicate():
                if self._stdout_closed:
                    raise EOFError(f"{self.name} ended its output (exit code {self.proc.returncode})")
                self._news.clear()
                await self._news.wait()

    def tail(self, n: int = 8) -> list[str]:
        """The last ``n`` lines of :attr:`lines`."""
        return list(self.lines)[-n:] if n > 0 else []

    def kill(self) -> None:
        """SIGKILL, now."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def wait(self, within_s: float | None = None) -> int:
        """Its exit code once it has exited (``TimeoutError`` after ``within_s``) and its output is read."""
        async with asyncio.timeout(within_s):
            code = await self.proc.wait()
        await self._finish_reading()
        return code

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """:func:`stop_processes` for this one; its exit code once its output is read."""
        await stop_processes([self.proc], grace_s)
        await self._finish_reading()
        return await self.proc.wait()

    async def _finish_reading(self) -> None:
        """Let the readers reach the end of the output of the exited child, or cancel them after ``DRAIN_S``
        (something it started still holds a pipe); raise a failure of a reader of its own."""
        await asyncio.wait(self._readers, timeout=DRAIN_S)
        for task in self._readers:
            task.cancel()
        await asyncio.wait(self._readers)
        if self._own_readers:
            for task in self._readers:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    raise exc
