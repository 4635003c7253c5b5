"""A step's averaging as one volunteer takes part in it: the gradient handed over, all-reduced over the
step's phases, and applied (with the parameters averaged every ``average_state_every`` steps).

With the run's ``averaging.delay = 1`` a round runs in the background while the next step's gradients are
computed on the same parameters, and its average is applied when that next step closes: :class:`Rounds`
holds that round and the gradient computed ahead for the next step (``early``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import numpy as np
import torch

from crowdtrain.protocol.errors import AveragingError, CrowdtrainError
from crowdtrain.protocol.messages import GroupAssignment, RoundVerdict, SpotCheck, round_tag
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.averaging.exchange import part_bounds
from crowdtrain.volunteer.joined import JoinedRun
from crowdtrain.volunteer.meter import Meter
from crowdtrain.volunteer.spotcheck import Checker
from crowdtrain.volunteer.trainer import all_finite


@dataclass(slots=True)
class Taken:
    """A step's gradient, taken out of the accumulation at its boundary (or, with delay 1, as soon as this
    peer's share of the step was computed)."""

    step: int
    weight: int  # this peer's samples in it
    compute_s: float
    loss: float | None
    grad: np.ndarray


@dataclass(slots=True)
class Round:
    """One step's averaging as this peer takes part in it."""

    step: int
    phases: list[GroupAssignment]
    weight: int  # this peer's samples in it
    catching_up: bool  # started while catching up: weight 0, its average is kept for the replay
    compute_s: float  # seconds of compute behind the gradient it contributes
    loss: float | None
    started: float  # monotonic
    mean: np.ndarray | None = None  # the averaged gradient (None: the round failed)
    params: np.ndarray | None = None  # averaged parameters, when the round averages them
    error: str | None = None  # why it failed as a whole
    check: SpotCheck | None = None  # a member's gradient of this step this peer recomputes (spot-check)

    @property
    def group_samples(self) -> int:
        if not self.phases:  # a round replayed after a catch-up
            return 0
        return self.phases[0].step_samples or sum(m.weight for m in self.phases[0].members)

    @property
    def average_params(self) -> bool:
        return bool(self.phases) and self.phases[0].average_params

    @classmethod
    def replayed(cls, step: int, mean: np.ndarray, params: np.ndarray | None) -> Round:
        """A round whose average arrived while catching up, to be applied when the current step closes."""
        return cls(step, [], 0, False, 0.0, None, time.monotonic(), mean=mean, params=params)


class RoundDiverged(AveragingError):
    """This peer's mean of a round is not the others' (it was cut, told of its failures too late, or lost a
    later phase's part with no verdicts): in a gradient round it fetches the run's state; in a parameter round
    it keeps its own parameters."""


@dataclass(slots=True)
class Agreed:
    """What a round's members agreed not to apply: the parts of this group (``lost``), this peer's failed
    parts the others were told to apply (``late``), the slices the other columns of a later phase's cluster
    lost (``ranges``), whether a member's input to a parameter round was not the mean (``spoiled``), and
    whether no verdicts came for a later phase that lost parts (``unknown``)."""

    lost: list[int]
    late: list[int] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    spoiled: bool = False
    unknown: bool = False


def _diverged(a: GroupAssignment, late: object, agreed: Agreed, spoiled: bool) -> str | None:
    """Why this peer's mean of phase ``a`` is not the other members' (``late``: the all-reduce's own; see
    :class:`Agreed`), or None."""
    where = f"phase {a.phase + 1} of {a.phases}"
    if late:
        # (the others averaged without my copy of those parts, or zeroed the part I own because the group
        # cut me: what I would apply is not what they apply)
        return (
            f"this peer was left out of {where} (it was asleep or too slow: its copies came after their owners "
            "closed, or the group cut it)"
        )
    if agreed.late:
        return (
            f"parts {agreed.late} of {where} failed here after the other members were told to apply them: this "
            "peer's mean is not theirs"
        )
    if spoiled and not agreed.spoiled and a.phase > 0:
        return f"the others were told too late that this peer's input to {where} was not the mean"
    if agreed.unknown:
        # (the other columns of this phase reduced those parts, and no verdicts say what they do)
        return f"parts {agreed.lost} of {where} failed and the tracker gave no verdicts on the other columns"
    return None


class Rounds:
    """The rounds of one volunteer: hand-over, all-reduce phases, apply; with delay 1, the round under way
    in the background and the gradient taken early."""

    def __init__(self, run: JoinedRun, meter: Meter) -> None:
        self.run = run
        self.meter = meter
        self._task: asyncio.Future[Round] | None = None  # delay 1: the step averaged in the background
        self.early: Taken | None = None  # delay 1: this step's gradient, taken once its share was computed
        self._grad_buf: np.ndarray | None = None  # delay 1 (or a GPU): the gradient handed to the all-reduce
        self._mean_bufs: list[np.ndarray | None] = [None, None]  # the mean lands here, phase by phase
        self.checker = Checker(run)
        self._applied_at: float | None = None  # when the last step was applied (monotonic)

    # ------------------------------------------------------------------ the round in the background

    def settled(self) -> bool:
        return self._task is None or self._task.done()

    def may_take_early(self, ahead_cap: int, notice: bool, catching_up: bool) -> bool:
        """Delay 1, its share of the step computed, the previous round done: the step's gradient can be
        taken now and the next step's computed ahead (the parameters it needs are known): ``ahead_cap``, what
        it may compute ahead, is above 0 and the tracker reports no run-wide problem (``notice``)."""
        run = self.run
        max_steps = run.config.max_steps
        return (
            run.spec.averaging.computes_ahead
            and self.early is None
            and not catching_up
            and run.trainer.samples > 0
            and ahead_cap > 0
            and self.settled()
            and not notice
            # the run's last step for this peer: nothing comes after it to compute ahead for
            and (max_steps is None or run.pos.step + 1 < max_steps)
        )

    async def settle(self) -> bool:
        """Wait until the round under way (delay 1) has ended, leaving it to be taken; False (for the loop: look
        at nothing else this turn). A run stepping faster than a round starts one at each close: a volunteer
        that fetched the state waits for this moment to switch to it, or it would never come."""
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task})
        return False

    @property
    def under_way(self) -> bool:
        return self._task is not None

    async def take_round(self) -> Round | None:
        task, self._task = self._task, None
        return None if task is None else await task

    def hold(self, rnd: Round) -> None:
        """Apply ``rnd`` when the current step closes (a round replayed after a catch-up)."""
        done = asyncio.get_running_loop().create_future()
        done.set_result(rnd)
        self._task = done

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.checker.cancel()

    def computed(self, provenance: list[tuple[int, int]], loss: float) -> None:
        """A micro-batch was accumulated: its samples are kept for spot-checks (and given to the tests'
        ``record``), by the step its gradient goes to (computing ahead: the next one)."""
        run = self.run
        toward = run.pos.step + (self.early is not None)
        run.averager.samples.computed(toward, provenance, loss)
        if run.me.record is not None:
            run.me.record(ev.BatchComputed(step=toward, provenance=tuple(provenance)))

    # ------------------------------------------------------------------ one round

    async def hand_over(self, catching_up: bool) -> tuple[Taken, Round | None]:
        """Take the step's gradient out of the accumulation; with delay 1, also the previous step's round (awaited
        first: it reads the buffer this gradient goes to), whose average the caller applies next."""
        run = self.run
        trainer = run.trainer
        loss, compute_s = self.meter.take_step()
        weight = 0 if catching_up else trainer.samples
        previous = await self.take_round()  # (delay 0: none is ever under way)
        if run.cadence.own_grad_buffer(trainer.device.type) and self._grad_buf is None:
            # a reused float32 host buffer of the model's size (pinned on a GPU: device copies run async)
            pinned = trainer.device.type == "cuda"
            self._grad_buf = torch.empty(trainer.numel, dtype=torch.float32, pin_memory=pinned).numpy()
        # delay 1: the gradient goes to a buffer of its own (the next step accumulates meanwhile); on the
        # CPU without delay, the accumulation buffer itself is handed to the all-reduce (no copy)
        grad = await asyncio.to_thread(trainer.take_grad, self._grad_buf)
        if catching_up:
            loss, compute_s = None, 0.0
        return Taken(step=run.pos.step, weight=weight, compute_s=compute_s, loss=loss, grad=grad), previous

    def keep_early(self, taken: Taken) -> None:
        """Delay 1: ``taken`` is this step's gradient, taken once its share was computed; the next step's
        micro-batches are computed meanwhile."""
        self.early = taken

    def take_early(self) -> Taken | None:
        """The step's gradient taken early, if any, no longer held here."""
        early, self.early = self.early, None
        return early

    def drop(self) -> int:
        """Drop the accumulated gradient (and one taken early): it was computed on parameters that are not
        the run's. Returns how many samples it held."""
        early = self.take_early()
        run = self.run
        dropped = run.trainer.samples + (early.weight if early else 0)
        run.trainer.reset_accumulation()
        run.averager.samples.dropped(run.pos.step)
        self.meter.drop_step()
        return dropped

    async def begin(self, rnd: Round, grad: np.ndarray) -> Round | None:
        """Average ``rnd`` now, and return it (delay 0), or in the background (delay 1: None; it is taken and
        applied when the next step closes)."""

        async def now() -> Round:
            self.run.phase("averaging")
            return await self.average(rnd, grad)

        def later() -> None:
            self._task = asyncio.get_running_loop().create_task(self.average(rnd, grad))

        return await self.run.cadence.begin(now, later)

    async def average(self, rnd: Round, grad: np.ndarray) -> Round:
        """All-reduce the step's gradient over its phases (and, with delay 1 on an averaging step, the
        parameters the gradient was computed on). A spot-check drawn for this peer is made once the round is
        over, before the average is applied (delay 0: the model still holds the step's parameters)."""
        checkable = self.run.spec.averaging.checkable
        check = rnd.check if rnd.phases and checkable and not rnd.catching_up else None
        began = time.monotonic()
        if check is not None:
            self.checker.wants(check, rnd.phases[0])
        try:
            # The mean lands in buffers reused every step (the trainer copies it into .grad), except while
            # catching up: those averages are kept for the replay.
            mean, failed = await self._phases(rnd.phases, grad, "grad", reuse=not rnd.catching_up)
        except AveragingError as exc:
            rnd.error = str(exc)
            if check is not None:  # (nothing to compare: the tracker forgets the check in a few steps)
                self.checker.drop(rnd.phases[0])
            return rnd
        if rnd.phases:  # (what a round of this step's members takes: the tracker sizes local rounds by it)
            self.meter.averaged(time.monotonic() - began)
        if check is not None:
            # (checking takes a share's compute: the parameter round this peer joins late must not cut it)
            ahead = [
                asyncio.create_task(self.run.averager.claim_ahead(a, round_tag("params", a.phase)))
                for a in rnd.phases
                if rnd.average_params
            ]
            try:
                await self.checker.check(check, rnd.phases[0])
                await asyncio.gather(*ahead)
            finally:
                for task in ahead:
                    task.cancel()
        if failed:
            self.run.note(
                logging.WARNING,
                "step %d: parts of the gradient were not averaged (their owner failed): %s; skipping them",
                rnd.step,
                "; ".join(failed),
            )
        rnd.mean = mean
        rnd.params = await self.run.cadence.params_in_round(
            rnd.average_params, lambda: self.average_params(rnd.phases)
        )
        return rnd

    async def step(self, rnd: Round, stepping: Callable[[], AbstractAsyncContextManager[None]]) -> None:
        """Apply a finished round's average (see :meth:`apply`) and say so (StepDone)."""
        run = self.run
        assert rnd.mean is not None
        run.phase("stepping")
        lr = await self.apply(rnd, rnd.mean, stepping)
        run.summary.stepped(rnd.loss)
        if rnd.weight > 0:
            self.meter.counted(rnd.compute_s)
        now = time.monotonic()
        wall_s, self._applied_at = (None if self._applied_at is None else now - self._applied_at), now
        run.emit(
            ev.StepDone(
                step=rnd.step,
                lr=lr,
                contributed_samples=rnd.weight,
                group_samples=rnd.group_samples,
                step_time_s=time.monotonic() - rnd.started,
                loss=rnd.loss,
                compute_s=rnd.compute_s,
                compute_share=self.meter.compute_share(),
                delayed=run.cadence.lag > 0,
                local=run.spec.averaging.local,
                wall_s=wall_s,
            )
        )

    async def apply(
        self, rnd: Round, mean: np.ndarray, stepping: Callable[[], AbstractAsyncContextManager[None]]
    ) -> float:
        """Apply a finished round's average ``mean`` to the model, each change of the tensors inside ``stepping``
        (the snapshotter's: no write reads them meanwhile, and a state is not kept half-changed); returns
        the learning rate it was applied with."""
        run = self.run
        trainer = run.trainer
        cadence, averages = run.cadence, run.averager.averages
        # (delay 0: the average is kept for peers that miss the step, who replay it)
        kept = await asyncio.to_thread(averages.copy, mean) if cadence.keeps_averages() else None
        async with stepping():  # (delay 1: with the averaged parameters this gradient was computed on)
            lr = await asyncio.to_thread(
                cadence.apply, mean, rnd.step, rnd.params, trainer.apply, trainer.set_flat_params
            )
        params = await cadence.params_after_step(rnd.average_params, lambda: self.average_params(rnd.phases))
        if params is not None:
            async with stepping():
                await asyncio.to_thread(trainer.set_flat_params, params)
        if kept is not None:
            await asyncio.to_thread(averages.applied, rnd.step, kept, params)
        return lr

    async def _phases(
        self, phases: list[GroupAssignment], vector: np.ndarray, tag: str, *, reuse: bool
    ) -> tuple[np.ndarray, list[str]]:
        """Run the step's phases in order, each phase's mean the next one's input, with this peer's weight
        in each; after the last, every peer of the step holds the same weighted mean. Without delay, each
        mean of the gradient overwrites the vector it is made of (nothing reads the gradient again, and no
        buffer of the model's size is needed; a catching-up peer writes it to its replay file before it
        accumulates again); with delay 1 and ``reuse`` the means land in two buffers kept between steps (the
        gradient's buffer receives the next step's gradient before this mean is applied).

        A part whose owner failed keeps its local values, which are this peer's alone: the values of every
        part that some member of the group (in a later phase: of any column of its cluster) could not apply
        are zeroed, as every such member does (tracker/verdicts.py), so the step's mean stays one; the
        failures are returned, one phrase each. A parameter round zeroes nothing: one that lost a part is
        *spoiled*, says so in its later phases, and every member keeps its own parameters. A peer whose mean
        is not the others' (cut, told its failures too late, or a later phase lost with no verdicts) raises
        :class:`RoundDiverged` (a gradient round: it fetches the state; a parameter round: it keeps its own
        parameters, healed by the next)."""
        run = self.run
        values, failed, spoiled = vector, [], False
        for i, a in enumerate(phases):
            [me] = [m for m in a.members if m.peer_id == run.peer_id]
            out = None
            if run.cadence.mean_in_place(tag):
                out = values
            elif reuse:
                buf = self._mean_bufs[i % 2]
                if buf is None or buf.size != vector.size:
                    buf = self._mean_bufs[i % 2] = np.empty_like(vector)
                out = buf
            # a tag per phase: a lossy codec's error feedback stays within what each phase sends
            phase_tag = round_tag(tag, a.phase)
            result = await run.averager.allreduce(a, values, float(me.weight), tag=phase_tag, out=out)
            # every member applies the same parts: those any member could not apply, none does
            agreed = await self._agreed_failures(
                a, phase_tag, result.failed_parts, spoiled, result.values.size
            )
            why = _diverged(a, result.late, agreed, spoiled)
            if why is not None:
                raise RoundDiverged(why)
            spoiled = spoiled or agreed.spoiled
            bounds = run.averager.bounds(a, result.values.size) if agreed.lost else []
            zeroed = [bounds[part] for part in agreed.lost] + agreed.ranges
            if zeroed and tag == "params":
                spoiled = True
            elif zeroed:
                for lo, hi in zeroed:
                    result.values[lo:hi] = 0.0
                failed.append(
                    f"phase {a.phase + 1} of {a.phases}, parts {agreed.lost}"
                    + (f" and {len(agreed.ranges)} slices lost in other columns" if agreed.ranges else "")
                )
            values = result.values
        if spoiled:
            failed.append("a part of a phase: the parameters' mean is not whole")
        return values, failed

    async def _agreed_failures(
        self, a: GroupAssignment, tag: str, mine: tuple[int, ...], spoiled: bool, size: int
    ) -> Agreed:
        """The parts of round ``a`` that some member could not apply (tracker/verdicts.py): mine, reported,
        and every other member's; those of mine the others were told to apply (reported too late); in a
        later phase the values the cluster's other columns lost. Alone in its group, or when the tracker
        does not answer, a peer goes by its own (in a later phase that is not enough: ``unknown``)."""
        run = self.run
        if len(a.members) < 2 and a.phase == 0:
            return Agreed(list(mine))
        verdict = RoundVerdict(
            peer_id=run.peer_id, assignment=a, tag=tag, failed=list(mine), spoiled=spoiled and a.phase > 0
        )
        try:
            reply = await run.tracker.verdicts(run.config.run_id, verdict, run.key, run.credential)
        except (CrowdtrainError, OSError) as exc:
            run.note(
                logging.INFO,
                "round %s/%s: no verdicts from the tracker (%s); going by this peer's own",
                a.round_id,
                tag,
                exc,
            )
            return Agreed(list(mine), unknown=bool(mine) and a.phase > 0)
        others = sorted(set(reply.failed) - set(mine))
        if others:
            run.note(
                logging.WARNING,
                "round %s: parts %s did not reach every member (or failed their receipts there): none applies them",
                a.round_id,
                others,
            )
        if reply.elsewhere:
            run.note(
                logging.WARNING,
                "round %s: %d other columns of its cluster lost parts: no member applies those values",
                a.round_id,
                len(reply.elsewhere),
            )
        align = run.averager.config.align
        ranges = [
            part_bounds(size, c.parts, c.part_weights, align)[p]
            for c in reply.elsewhere
            for p in c.failed
            if 0 <= p < c.parts
        ]
        return Agreed(sorted(set(reply.failed) | set(mine)), list(reply.late), ranges, reply.spoiled)

    async def average_params(self, phases: list[GroupAssignment]) -> np.ndarray | None:
        """Average parameters over the step's peers, in the same phases and with the same weights as the
        gradient (a peer with weight 0, e.g. catching up, only receives): heals any drift. None if nothing
        usable came back."""
        run = self.run
        params = await asyncio.to_thread(run.trainer.flat_params)
        try:
            values, failed = await self._phases(phases, params, "params", reuse=False)
        except AveragingError as exc:
            run.note(logging.WARNING, "parameter averaging failed (%s); keeping local parameters", exc)
            return None
        if failed or not all_finite(values):
            run.note(logging.WARNING, "parameter averaging was partial; keeping local parameters")
            return None
        return values
