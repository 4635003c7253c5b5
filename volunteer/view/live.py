"""ViewSink: the consumer the engine emits into, drawing the live view or printing lines.

``emit`` only appends to a queue (thread-safe, never renders, never blocks). ``run`` is one long-lived
task: in live mode it folds the queued events into the :class:`ViewState` and redraws with
``live.update(render(state), refresh=True)`` at most ``max_refresh_hz`` times a second (rich ``Live``
with ``auto_refresh=False``), redrawing about once a second when idle so the uptime ticks; Python
``logging`` goes through a ``RichHandler`` on ``live.console`` so log records print above the view. In
plain and json mode it prints one line per event. ``close`` flushes what is queued and stops ``run``.

    sink = ViewSink(choose_mode("live", sys.stdout))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(sink.run())
        ... engine(emit=sink.emit) ...
        await sink.close()
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.logging import RichHandler

from crowdtrain.protocol.errors import ConfigError
from crowdtrain.volunteer.events import Event
from crowdtrain.volunteer.view.lines import LineThrottle, json_line, plain_line
from crowdtrain.volunteer.view.render import render
from crowdtrain.volunteer.view.state import ViewState, apply

MODES = ("live", "plain", "json")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ViewConfig:
    mode: str = "live"
    max_refresh_hz: float = 4.0  # live mode: redraws per second at most
    idle_refresh_s: float = 1.0  # live mode: redraw this often without events (uptime)
    plain_interval_s: float = 5.0  # plain mode: one chatty line per event type per this many seconds

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not 0 < self.max_refresh_hz <= 60:
            raise ConfigError(
                "max_refresh_hz", f"must be in (0, 60] redraws per second, not {self.max_refresh_hz}"
            )
        if not 0 < self.idle_refresh_s <= 3600:
            raise ConfigError("idle_refresh_s", f"must be in (0, 3600] seconds, not {self.idle_refresh_s}")
        if not 0 <= self.plain_interval_s <= 3600:
            raise ConfigError(
                "plain_interval_s", f"must be in [0, 3600] seconds, not {self.plain_interval_s}"
            )


def choose_mode(requested: str, stream: TextIO | Console) -> str:
    """``requested``, except that ``live`` becomes ``plain`` when ``stream`` is not an interactive terminal."""
    if requested not in MODES:
        raise ConfigError("mode", f"must be one of {', '.join(MODES)}, not {requested!r}")
    if requested != "live":
        return requested
    if isinstance(stream, Console):
        interactive = stream.is_terminal and not stream.is_dumb_terminal
    else:
        isatty = getattr(stream, "isatty", None)
        try:
            interactive = bool(isatty and isatty())
        except ValueError:  # a closed stream
            interactive = False
    return "live" if interactive else "plain"


class ViewSink:
    """Consumes engine events; see the module docstring.

    ``out`` is a rich :class:`Console` or a text stream (default: ``sys.stdout``). Counters for tests and
    benchmarks: ``renders`` (calls of :func:`render`), ``events_applied``, ``lines_written``.
    """

    def __init__(
        self,
        mode: str = "live",
        out: Console | TextIO | None = None,
        *,
        max_refresh_hz: float = 4.0,
        idle_refresh_s: float = 1.0,
        plain_interval_s: float = 5.0,
        route_logging: bool = True,
    ) -> None:
        self.config = ViewConfig(mode, max_refresh_hz, idle_refresh_s, plain_interval_s)
        out = sys.stdout if out is None else out
        if isinstance(out, Console):
            self.console = out
            self._stream: IO[str] = out.file
        else:
            self.console = Console(file=out)
            self._stream = out
        self.route_logging = route_logging
        self.state = ViewState()
        self.renders = 0
        self.events_applied = 0
        self.lines_written = 0
        self._pending: deque[Event] = deque()
        self._throttle = LineThrottle(plain_interval_s)
        self._wake = asyncio.Event()
        self._done = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closed = False
        self._line_mode = "json" if mode == "json" else "plain"
        self._live_ok = True

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def showing(self) -> str:
        """What the sink prints now: its mode, or ``plain`` after the live view failed."""
        return self.config.mode if self.config.mode != "live" or self._live_ok else self._line_mode

    # ------------------------------------------------------------ producer side

    def emit(self, event: Event) -> None:
        """Queue ``event``; cheap, never blocks, callable from any thread. Dropped after :meth:`close`."""
        if self._closed:
            return
        self._pending.append(event)
        loop = self._loop
        if loop is None:
            return  # run() has not started; it drains the queue first
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        elif not self._wake.is_set():  # (a stale read only costs one extra wake-up)
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop has closed; the event stays queued and is dropped
                pass

    # ------------------------------------------------------------ consumer side

    async def run(self) -> None:
        """Apply and show queued events until :meth:`close`. Run it as a task."""
        if self._loop is not None:
            raise RuntimeError("ViewSink.run() is already running; start it once")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        try:
            if self._closed:
                return
            if self.mode == "live":
                if await self._run_live():
                    return
                log.error("the live view failed (see the traceback above); printing plain lines from here on")
                self._live_ok = False
            await self._run_lines()
        finally:
            self._done.set()

    async def close(self) -> None:
        """Show what is still queued, then stop :meth:`run` (and wait for it, if it is running)."""
        if self._closed:
            if self._loop is not None:
                await self._done.wait()
            return
        self._closed = True
        if self._loop is not None:
            self._wake.set()
            await self._done.wait()
        elif self.mode == "live":
            if self._pending and (frame := self._next_frame()) is not None:  # run() never ran: one frame
                self.console.print(frame)
        else:
            self._drain_lines()

    # ------------------------------------------------------------ internals

    def _drain_state(self) -> bool:
        changed = False
        while self._pending:
            self.state = apply(self.state, self._pending.popleft())
            self.events_applied += 1
            changed = True
        return changed

    def _drain_lines(self) -> None:
        wrote = False
        while self._pending:
            event = self._pending.popleft()
            self.events_applied += 1
            try:
                if self._line_mode == "json":
                    line: str | None = json_line(event)
                else:
                    line = plain_line(event) if self._throttle.admit(event) else None
            except Exception:  # a malformed event must not stop the engine: say so and go on
                log.exception("could not print a %s event; skipped it", type(event).__name__)
                continue
            if line is not None:
                self._stream.write(line + "\n")
                self.lines_written += 1
                wrote = True
        if wrote:
            self._stream.flush()

    def _render(self, now: float) -> RenderableType:
        self.renders += 1
        return render(self.state, now)

    async def _run_lines(self) -> None:
        while True:
            self._wake.clear()
            self._drain_lines()
            if self._closed:
                self._drain_lines()
                return
            await self._wake.wait()

    def _next_frame(self) -> RenderableType | None:
        """Fold the queue and draw; ``None`` (after logging the traceback) if an event or the view is broken."""
        try:
            self._drain_state()
            return self._render(time.time())
        except Exception:  # a view bug must not stop the engine's TaskGroup
            log.exception("the live view could not draw the latest events")
            return None

    async def _run_live(self) -> bool:
        """Draw until closed; ``False`` if drawing failed (the caller falls back to plain lines)."""
        interval = 1.0 / self.config.max_refresh_hz
        idle = max(self.config.idle_refresh_s, interval)
        first = self._next_frame()
        if first is None:
            return False
        with Live(first, console=self.console, auto_refresh=False) as live:
            last_render = time.monotonic()
            restore = self._route_logging(live.console) if self.route_logging else None
            try:
                while not self._closed:
                    if not self._pending:
                        try:
                            async with asyncio.timeout(max(0.0, last_render + idle - time.monotonic())):
                                await self._wake.wait()
                        except TimeoutError:
                            pass  # idle: redraw anyway so the uptime moves
                    # The rate bound: redraws are at least `interval` apart, however fast events come.
                    # (A millisecond more: the loop may wake a timer up to its clock resolution early.)
                    wait = last_render + interval - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait + 0.001)
                    self._wake.clear()
                    frame = self._next_frame()
                    if frame is None:
                        return False  # leaving `with Live` shows the last good frame
                    live.update(frame, refresh=True)
                    last_render = time.monotonic()
            finally:
                if restore is not None:
                    restore()
        return True

    def _route_logging(self, console: Console) -> Callable[[], None]:
        """Send the root logger's records through a RichHandler above the view; returns the undo."""
        root = logging.getLogger()
        handler = RichHandler(console=console, show_path=False)
        std = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
        moved = [
            h for h in root.handlers if type(h) is logging.StreamHandler and getattr(h, "stream", None) in std
        ]
        for h in moved:
            root.removeHandler(h)
        root.addHandler(handler)

        def restore() -> None:
            root.removeHandler(handler)
            for h in moved:
                root.addHandler(h)

        return restore
