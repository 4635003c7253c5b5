"""The volunteer engine: join a run, train on the chunks it has, average with its group, step, repeat.

The engine emits :mod:`crowdtrain.volunteer.events` and never imports rich. One :class:`Volunteer` lives in
one ``asyncio.run``: it joins (:mod:`~crowdtrain.volunteer.joined`), trains (:mod:`~crowdtrain.volunteer.loop`:
the training loop as a state machine over the parts it wires: the tracker link, the data, a step's rounds,
snapshots, catch-up, the volunteer's figures) and leaves, in order, whatever ends it.
"""

from __future__ import annotations

import asyncio

from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import RunSpec
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.config import VolunteerConfig
from crowdtrain.volunteer.joined import JoinedRun, Summary, Volunteering, join_run, load_checkpoint
from crowdtrain.volunteer.loop import Training
from crowdtrain.volunteer.trainer import Trainer

__all__ = ["Summary", "Volunteer", "load_checkpoint"]


class Volunteer:
    """One volunteer. ``emit`` receives its events (for the view, the JSON lines).

    ``record`` is for tests: a callable that receives :class:`~crowdtrain.volunteer.events.BatchComputed`
    (each micro-batch's provenance, by the step its gradient was accumulated toward) and
    :class:`~crowdtrain.volunteer.events.ParamsAfterStep` (a copy of the flat parameters after each applied
    step, and after a catch-up). It is given at construction, never changed, and kept apart from ``emit``:
    a copy of the model's size is taken only when a ``record`` was given, right after the step is applied and
    before training goes on (it holds that step's parameters). Without one (the CLI), no copy is made.
    """

    def __init__(
        self, config: VolunteerConfig, emit: ev.Emit = ev.no_emit, record: ev.Record | None = None
    ) -> None:
        self.config = config
        self.summary = Summary()
        # (its data folder's key replaces this one when it joins: volunteer/folder.py)
        self._me = Volunteering(config, SigningKey(), self.summary, asyncio.Event(), emit, record)
        self._run: JoinedRun | None = None  # once joined
        self._training: Training | None = None

    # what a caller may read of it while it runs (None / 0 / "" until it joined)

    @property
    def peer_id(self) -> str:
        return self.summary.peer_id

    @property
    def step(self) -> int:
        """The global step this peer accumulates for."""
        return self._run.pos.step if self._run is not None else self.summary.first_step

    @property
    def spec(self) -> RunSpec | None:
        return self._run.spec if self._run is not None else None

    @property
    def trainer(self) -> Trainer | None:
        return self._run.trainer if self._run is not None else None

    @property
    def samples_per_s(self) -> float:
        return self._training.meter.samples_per_s if self._training is not None else 0.0

    def stop(self) -> None:
        """Ask the engine to leave after the current micro-batch or round."""
        self._me.stop.set()

    async def run(self) -> Summary:
        """Join, train until the run ends, ``max_steps`` or :meth:`stop`, and leave; Ctrl-C (cancellation)
        leaves too, in order, and is raised again."""
        reason = "finished"
        try:
            async with join_run(self._me) as run:
                self._run = run
                self._training = Training(run)
                await _train(self._training)
        except asyncio.CancelledError:
            reason = "interrupted"
            raise
        finally:
            if self.summary.peer_id:  # it joined: it left
                share = self._training.meter.compute_share() if self._training is not None else None
                self.summary.left(self.step, share)
                # (closed, deleted or this key barred: the tracker's sentence says which, and why)
                self._me.emit(ev.Left(reason=self.summary.ended or reason))
        return self.summary


async def _train(t: Training) -> None:
    """Run the parts' long-lived tasks and the training loop in one TaskGroup; take them down in order."""
    run = t.run
    run.announce()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(t.data.stream())
            tg.create_task(t.link.heartbeats())
            watch = tg.create_task(t.link.watch())
            tg.create_task(t.data.stats())
            tg.create_task(run.me.sleeps.watch(run.me.stop))
            await tg.create_task(t.train())
            run.me.stop.set()
            watch.cancel()  # its long-poll would hold the exit for up to WATCH_S
    finally:
        run.me.stop.set()
        run.phase("leaving")
        t.catchup.cancel()
        t.link.cancel_ready()
        t.rounds.cancel()
        t.snaps.cancel()
        await t.snaps.written()  # a thread: let it finish its file
        # (catching up or waiting, it does not hold the run's state)
        if not t.catchup.active and t.catchup.waiting is None:
            await t.snaps.keep()
