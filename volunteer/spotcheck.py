"""Spot-checks, the volunteer's side (who checks whom and what a verdict costs is the tracker's:
:mod:`crowdtrain.tracker.spotchecks`).

As a *suspect*, every volunteer keeps the samples of its gradients of its last steps and serves them to
checkers (:mod:`crowdtrain.volunteer.averaging.samples`).

As a *checker* (the tracker names it in its ready reply, with the suspect), a volunteer keeps the suspect's
copy of the part it owns in the step's first phase (the averager's reducer, before the mean scales it),
asks the suspect for its samples as soon as that copy is in (the suspect has committed to it: a cheater
cannot learn of the check and send an honest copy instead), rebuilds its micro-batches from the data set
and, before it applies the step's average (every-step mode with delay 0: its model still holds the
parameters every member computed its gradient at; no copy of the model is made), recomputes the suspect's
gradient of its part in a thread and compares, over the values of its part that hold gradient (the
buffers' values that follow the gradient in the vector depend on each member's own forward passes):
``match`` when the copy is within GRAD_TOLERANCE of the recomputed gradient (:func:`apart`) and the losses
agree within LOSS_TOLERANCE; ``mismatch`` otherwise; ``unanswered`` when the suspect does not
answer (or answers nonsense); ``unverifiable`` when this peer cannot recompute it (a chunk it does not hold
yet, a model with dropout). The verdict goes to the tracker.

The tolerances: the copy went through the run's codec (int8: honest copies up to 0.31 apart beyond a
quantisation step, 0.34 raw, in ``bench/spotchecks.py``; none: 0) and the suspect may compute on another
device (a GPU in bf16 against a CPU in fp32 adds bf16's rounding); a gradient of the same model on other
samples was 1.03–1.34 apart, one sent 3 steps late 0.22–5.4 (most above 0.67). A rare honest copy beyond
the tolerance is absorbed by the tracker's rule (rejections must be 10 % of a key's checks to bar it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
import numpy as np
import torch

from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.aio import BodyTooLong, read_body, wait_at_most
from crowdtrain.protocol.codecs import int8_steps
from crowdtrain.protocol.errors import CrowdtrainError, ProtocolError
from crowdtrain.protocol.limits import Limits
from crowdtrain.protocol.messages import (
    MAX_CHECKED_SAMPLES,
    GroupAssignment,
    SpotCheck,
    SpotCheckAnswer,
    SpotCheckVerdict,
    SpotOutcome,
    decode,
)
from crowdtrain.protocol.peerauth import sign_headers
from crowdtrain.protocol.peerclient import PeerClient, PeerUnreachable
from crowdtrain.volunteer.averaging.samples import PURPOSE
from crowdtrain.volunteer.averaging.wire import KeptPart

if TYPE_CHECKING:
    from crowdtrain.volunteer.joined import JoinedRun
    from crowdtrain.volunteer.trainer import Trainer


GRAD_TOLERANCE = 0.5  # relative L2 distance between the copy and the recomputed gradient, beyond a step
LOSS_TOLERANCE = 0.02  # relative distance between the losses
ASK_TIMEOUT_S = 10.0  # the suspect's answer, from the request
CHECK_VALUES = (
    1 << 22
)  # values of a part compared at most (16 MB of float32): a random window of whole frames
ANSWER_WAIT_S = 1.0  # how long this peer's step waits for it after the round (a frozen suspect: unanswered)
ANSWER_LIMITS = Limits(max_json_bytes=32 * MAX_CHECKED_SAMPLES)


class Checker:
    """The checker's side: recompute a suspect's gradient of a step and tell the tracker what it found."""

    def __init__(self, run: JoinedRun) -> None:
        self.run = run
        self._reports: set[asyncio.Task[None]] = set()
        self._asking: dict[str, asyncio.Task[SpotCheckAnswer | str]] = {}  # round id -> the suspect's answer
        self._sampler: Sampler | None = None
        self._rng = random.SystemRandom()

    def wants(self, check: SpotCheck, group: GroupAssignment) -> None:
        """Before the round: keep the suspect's copy of my part of the step's first phase, and ask the suspect
        for its samples as soon as that copy is in (so the answer is usually here when the round ends)."""
        arrived = asyncio.Event()
        self.run.averager.wanted[group.round_id] = (check.suspect, arrived)
        address = next((m.address for m in group.members if m.peer_id == check.suspect), None)
        if address is not None:
            self._asking[group.round_id] = asyncio.get_running_loop().create_task(
                self._ask_once_in(arrived, check, address, group.deadline)
            )

    async def _ask_once_in(
        self, arrived: asyncio.Event, check: SpotCheck, address: str, deadline: float
    ) -> SpotCheckAnswer | str:
        if not await wait_at_most(arrived, max(0.0, deadline - time.time())):
            return "its copy of my part did not arrive by the round's deadline"
        return await self._ask(check, address)

    async def check(self, check: SpotCheck, group: GroupAssignment) -> None:
        """After the round, before the step is applied (the model holds the step's parameters): take the
        suspect's samples (waiting at most ANSWER_WAIT_S more for them), recompute its gradient of my part on
        this model (in a thread; this peer's step waits for it, about the suspect's share of a step's
        compute) and report in the background."""
        kept = self.run.averager.kept.pop(group.round_id, None)
        self.run.averager.wanted.pop(group.round_id, None)
        asking = self._asking.pop(group.round_id, None)
        model = self.run.trainer.model
        why = (
            "the suspect's copy of my part did not arrive"
            if kept is None
            else "the suspect has no address to ask"
            if asking is None
            else "the model has dropout: its gradients are not reproducible"
            if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
            else None
        )
        if why is not None:
            if asking is not None:
                asking.cancel()
            self._report(check, "unverifiable", why)
            return
        assert kept is not None and asking is not None
        done, _ = await asyncio.wait([asking], timeout=ANSWER_WAIT_S)
        if not done:
            asking.cancel()
        answer = asking.result() if done else f"no answer within {ANSWER_WAIT_S} s of the round's end"
        if isinstance(answer, str):
            self._report(check, "unanswered", answer)
            return
        started = time.perf_counter()
        try:
            outcome, detail = await asyncio.to_thread(self._compare, answer, kept)
        except CrowdtrainError as exc:
            self._report(check, "unverifiable", str(exc)[:90])
            return
        samples = sum(len(b) for b in answer.batches)
        self._report(check, outcome, f"{samples} samples in {time.perf_counter() - started:.2f} s; {detail}")

    def drop(self, group: GroupAssignment) -> None:
        """The round failed as a whole: nothing to compare (the tracker forgets the check in a few steps)."""
        self.run.averager.wanted.pop(group.round_id, None)
        asking = self._asking.pop(group.round_id, None)
        if asking is not None:
            asking.cancel()

    def cancel(self) -> None:
        for task in [*self._reports, *self._asking.values()]:
            task.cancel()

    async def _ask(self, check: SpotCheck, address: str) -> SpotCheckAnswer | str:
        """The suspect's samples of the step, or why they could not be had."""
        headers = sign_headers(self.run.key, self.run.credential, PURPOSE, check.step)
        timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
        try:
            path = f"/v1/spotcheck/{check.step}"
            async with (
                PeerClient() as client,
                client.get(address, path, headers=headers, timeouts=timeout) as resp,
            ):
                body = await read_body(resp.content, ANSWER_LIMITS.max_json_bytes, resp.content_length)
                if resp.status != 200:
                    return f"answered {resp.status}"
            answer = decode(body, SpotCheckAnswer, ANSWER_LIMITS)
        except (PeerUnreachable, BodyTooLong, ProtocolError) as exc:
            return f"{type(exc).__name__}: {exc}"[:90]
        if answer.step != check.step:
            return f"answered for step {answer.step}"
        return answer

    def _compare(
        self, answer: SpotCheckAnswer, kept: tuple[int, int, np.ndarray | KeptPart]
    ) -> tuple[SpotOutcome, str]:
        """Recompute (in a thread) and compare; returns the outcome and its figures. The values compared are a
        window of at most CHECK_VALUES of my part, drawn at random (a cheater cannot know which), so what a
        check holds in memory does not grow with the model."""
        run = self.run
        if self._sampler is None:
            cut = run.sample_cut()
            self._sampler = Sampler(run.spec.dataset.manifest, run.config.data_dir, seed=0, **cut)
        trainer: Trainer = run.trainer
        named = [sample for batch in answer.batches for sample in batch]
        if not named or not all(self._sampler.offers(i, o) for i, o in named):
            return "mismatch", "it named no samples, or samples outside the run's data set"
        holdout = len(run.spec.dataset.manifest.chunks) - run.spec.eval.holdout_chunks
        if run.spec.eval.every and any(i >= holdout for i, _ in named):
            return "mismatch", "it named samples of the held-out chunks"
        a, b, copy = kept
        stop = min(b, trainer.param_numel)  # the gradient's values of my part (the buffers' follow)
        if stop <= a:
            return "unverifiable", "my part holds no gradient values"
        frames = window(stop - a, copy.step if isinstance(copy, KeptPart) else 1 << 20, self._rng)
        # (a sample of a chunk this peer does not hold yet: DatasetError, "unverifiable")
        batches = [self._sampler.rebuild(batch) for batch in answer.batches]
        lo, hi = frames[0][0], frames[-1][1]
        mine, loss_sum = recompute(trainer, batches, a + lo, a + hi)
        sums = np.zeros(3)  # Σ mine², Σ (sent − mine)², Σ beyond a step²
        for fa, fb in frames:  # (an int8 copy's blocks start at each frame)
            # (a kept copy decodes whole frames; the last may hold buffers' values past the gradient's)
            sent = (
                copy.values(fa, min(fa + copy.step, copy.length))
                if isinstance(copy, KeptPart)
                else copy[fa:fb]
            )
            sums += squares(sent[: fb - fa], mine[fa - lo : fb - lo], run.spec.averaging.codec)
        norm = math.sqrt(sums[0])
        raw, distance = (math.sqrt(x) / norm if norm > 0 else math.sqrt(x) for x in sums[1:])
        loss_off = abs(answer.loss_sum - loss_sum) / max(abs(loss_sum), 1e-6)
        detail = f"gradient {distance:.4f} apart ({raw:.4f} raw, {hi - lo} values), loss {loss_off:.4f}"
        if math.isfinite(distance) and distance <= GRAD_TOLERANCE and loss_off <= LOSS_TOLERANCE:
            return "match", detail
        return "mismatch", detail

    def _report(self, check: SpotCheck, outcome: SpotOutcome, detail: str) -> None:
        """Note the verdict and send it to the tracker in the background."""
        run = self.run
        verdict = SpotCheckVerdict(
            peer_id=run.peer_id, step=check.step, suspect=check.suspect, outcome=outcome, detail=detail[:100]
        )
        level = logging.WARNING if outcome == "mismatch" else logging.INFO
        run.note(level, "spot-check of %s at step %d: %s (%s)", check.suspect, check.step, outcome, detail)

        async def send() -> None:
            try:
                await run.tracker.spot_check(run.config.run_id, verdict, run.key, run.credential)
            except CrowdtrainError as exc:
                run.note(logging.INFO, "could not report a spot-check to the tracker (%s)", exc)

        task = asyncio.get_running_loop().create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)


def window(n: int, frame: int, rng: random.Random) -> list[tuple[int, int]]:
    """The frames ``[start, stop)`` of a random window of at most CHECK_VALUES of a part's first ``n`` values
    (whole frames of ``frame`` values, as the part was sent; at least one frame)."""
    count = -(-n // frame)
    take = max(1, min(count, CHECK_VALUES // frame))
    first = rng.randrange(count - take + 1)
    return [(k * frame, min((k + 1) * frame, n)) for k in range(first, first + take)]


def squares(sent: np.ndarray, mine: np.ndarray, codec: str) -> np.ndarray:
    """For one frame of a member's copy (``sent``, decoded) and the gradient recomputed here (``mine``): Σ
    mine², Σ (sent − mine)², and Σ of what lies beyond what the codec explains, squared. An int8 copy is
    quantised per block of INT8_BLOCK values (from the frame's start) to steps of the block's absmax ÷ 127 (a
    block with one large value quantises its small ones to nothing), and carries the sender's error feedback:
    half a step now, and at most half a step of the value's own block of what earlier rounds owed (the rest
    waits: a residual of larger values, after a spike or rounds ago, outweighed the gradient;
    see ``ErrorFeedback``). Only what lies beyond one step of the value's block counts; honest copies were
    still up to 0.31 beyond it (0.34 raw), see the module."""
    diff = np.abs(sent - mine)
    out = np.array([np.dot(mine, mine), np.dot(diff, diff), 0.0], dtype=np.float64)
    if codec != "int8":
        out[2] = out[1]
        return out
    step = int8_steps(sent)
    beyond = np.maximum(diff - step, 0.0)
    out[2] = np.dot(beyond, beyond)
    return out


def recompute(trainer: Trainer, batches: Sequence, a: int, b: int) -> tuple[np.ndarray, float]:
    """Values ``[a, b)`` of the mean gradient (the trainer's flat layout) of the trainer's model over
    ``batches``, as :meth:`Trainer.accumulate` computes it (each micro-batch's n × mean loss
    back-propagated), and Σ n × loss. Only the parameters that hold those values get a gradient
    (``torch.autograd.grad``: the trainer's own ``.grad`` buffer, which holds the step's average, is not
    touched, and no copy of the model is made)."""
    spans, offset = [], 0
    for p in trainer.params:
        if offset < b and offset + p.numel() > a:
            spans.append((offset, p))
        offset += p.numel()
    sums: list[torch.Tensor] | None = (
        None  # (the first micro-batch's gradients: no buffer of zeros beside them)
    )
    trainer.model.train()
    total, samples = 0.0, 0
    for batch in batches:
        n = len(batch)
        x = torch.from_numpy(np.ascontiguousarray(batch.x)).to(trainer.device)
        y = torch.from_numpy(np.ascontiguousarray(batch.y)).to(trainer.device)
        with trainer._autocast():
            loss = trainer.recipe.loss(trainer.model, x, y)
        grads = torch.autograd.grad(loss * n, [p for _, p in spans], allow_unused=True)
        got = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, spans, strict=True)]
        if sums is None:
            sums = got
        else:
            for acc, g in zip(sums, got, strict=True):
                acc += g
        del grads, got
        total += float(loss.detach()) * n
        samples += n
    assert sums is not None  # (a check names at least one sample)
    out = np.empty(b - a, dtype=np.float32)  # each parameter's overlap with [a, b), copied once
    for (offset, _), g in zip(spans, sums, strict=True):
        lo, hi = max(a, offset), min(b, offset + g.numel())
        out[lo - a : hi - a] = g.reshape(-1)[lo - offset : hi - offset].detach().cpu().numpy()
    out /= max(samples, 1)
    return out, total
