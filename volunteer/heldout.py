"""The run's held-out split (``spec.eval``): its chunks feed an evaluation sampler, never training, and every
volunteer evaluates the same samples every ``eval.every`` applied steps."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from crowdtrain.datasets.sampler import Batch, Sampler
from crowdtrain.protocol.messages import EvalReport
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.joined import JoinedRun


class HeldOut:
    """The held-out chunks, the samples drawn from them once all are held, and the newest report."""

    def __init__(self, run: JoinedRun, cut: dict[str, int | None]) -> None:
        self.run = run
        spec = run.spec
        self.chunks: frozenset[int] = frozenset()
        self._sampler: Sampler | None = None
        if spec.eval.every:
            n = len(spec.dataset.manifest.chunks)
            self.chunks = frozenset(range(n - spec.eval.holdout_chunks, n))
            # the run's seed: every volunteer draws the same held-out samples
            self._sampler = Sampler(spec.dataset.manifest, run.config.data_dir, seed=spec.seed, **cut)
        self._batch: Batch | None = None  # drawn once every held-out chunk is held: the same everywhere
        self.report: EvalReport | None = None  # the newest, sent with every heartbeat

    def add_chunk(self, index: int) -> bool:
        """Take a verified chunk if it is held out (False: it is for training). Raises DatasetError."""
        if index not in self.chunks or self._sampler is None:
            return False
        self._sampler.add_chunk(index)
        if self._sampler.held == self.chunks and self._sampler.ready:
            self._batch = self._sampler.batch(self.run.spec.eval.samples)
        return True

    def due(self, applied: int) -> bool:
        every = self.run.spec.eval.every
        return bool(every) and applied % every == 0 and self._batch is not None

    async def evaluate(self, step: int) -> bool:
        """Evaluate the state after ``step`` steps on the held-out samples; True when a report was made
        (the next heartbeats carry it)."""
        run, batch = self.run, self._batch
        if batch is None:
            return False
        run.phase("evaluating")
        started = time.monotonic()
        loss, metrics = await asyncio.to_thread(
            run.trainer.evaluate_with_metrics, batch.x, batch.y, run.spec.micro_batch_size
        )
        if not math.isfinite(loss):
            run.note(logging.WARNING, "the held-out loss of step %d is %s; not reported", step, loss)
            return False
        self.report = EvalReport(step=step, loss=loss, metrics=metrics, samples=len(batch))
        run.emit(
            ev.Evaluated(
                step=step,
                loss=loss,
                metrics=metrics,
                samples=len(batch),
                duration_s=time.monotonic() - started,
            )
        )
        return True
