"""Training batches drawn only from verified chunks, with a seeded RNG, replayable from provenance.

Language modelling (``tokens``): a sample is a window of ``seq_len + 1`` consecutive tokens inside one
chunk, split into ``x = w[:-1]`` and ``y = w[1:]`` (int64). Windows never cross chunk boundaries, so a
chunk is usable on its own the moment it is verified. Supervised sets (``arrays``): a sample is one row.

Each sample first picks a held chunk with probability proportional to the samples (windows) it offers,
then a uniform offset in it; the ``(chunk index, offset)`` pairs are returned as ``provenance``, and
:meth:`Sampler.take` rebuilds exactly the same batch from them (a single-process reference uses it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crowdtrain.datasets.chunks import load_chunk
from crowdtrain.protocol.errors import ConfigError, DatasetError
from crowdtrain.protocol.messages import DatasetManifest


@dataclass(frozen=True, slots=True)
class Batch:
    x: np.ndarray
    y: np.ndarray | None  # None for an arrays set without labels
    provenance: list[tuple[int, int]]  # (chunk index, offset) of each sample, in order

    def __len__(self) -> int:
        return len(self.provenance)


class Sampler:
    def __init__(
        self,
        manifest: DatasetManifest,
        data_dir: str | os.PathLike,
        *,
        seed: int,
        seq_len: int | None = None,
        vocab: int | None = None,
    ) -> None:
        """``vocab``: token ids must stay below it (the run's model embeds no other); a chunk holding a larger
        id is refused when it is added, in one sentence."""
        if manifest.kind == "tokens":
            if seq_len is None or seq_len < 1:
                raise ConfigError(
                    "seq_len", "a tokens data set needs seq_len ≥ 1 (tokens per training window)"
                )
        elif seq_len is not None:
            raise ConfigError("seq_len", "only tokens data sets take seq_len; an arrays sample is one row")
        self.manifest = manifest
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.vocab = vocab if manifest.kind == "tokens" else None
        if manifest.chunks and not any(self._span(i) > 0 for i in range(len(manifest.chunks))):
            raise ConfigError(
                "seq_len",
                f"{seq_len} + 1 tokens is longer than every chunk of data set {manifest.name!r}; "
                "use a shorter seq_len or make the data set with a larger --chunk-size",
            )
        self._rng = np.random.default_rng(seed)
        self._chunks: dict[int, np.ndarray] = {}
        self._held: list[int] = []  # sorted, usable chunks only
        self._weights = np.zeros(0)

    # -------------------------------------------------------------- growing

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._chunks)

    @property
    def ready(self) -> bool:
        """True once at least one chunk offers a sample."""
        return bool(self._held)

    def _span(self, index: int) -> int:
        """Samples (tokens: window start positions) chunk ``index`` offers."""
        n = self.manifest.chunks[index].samples
        # seq_len is set for a tokens set and only for one (checked in __init__); an arrays sample is one row
        return n if self.seq_len is None else max(0, n - self.seq_len)

    def add_chunk(self, index: int) -> None:
        """Add a verified chunk; its file is checked against the manifest's sha256 once more."""
        if not 0 <= index < len(self.manifest.chunks):
            raise DatasetError(f"Chunk index {index} is outside data set {self.manifest.name!r}.")
        if index in self._chunks:
            return
        info = self.manifest.chunks[index]
        chunk = load_chunk(self.data_dir / info.name, info, self.manifest, mmap=True)
        if self.vocab is not None and chunk.size and (top := int(chunk.max())) >= self.vocab:
            raise DatasetError(
                f"Chunk {info.name} of data set {self.manifest.name!r} holds token id {top}, but the run's model "
                f"has a vocabulary of {self.vocab} (ids 0 to {self.vocab - 1}); the run's spec does not fit its "
                "data set; tell its publisher (a `run create` of this version refuses such a spec)."
            )
        self._chunks[index] = chunk
        if self._span(index) > 0:
            self._held = sorted([*self._held, index])
            spans = np.array([self._span(i) for i in self._held], dtype=np.float64)
            self._weights = spans / spans.sum()

    def offers(self, index: int, offset: int) -> bool:
        """Whether sample ``(index, offset)`` is one of the data set's (held or not)."""
        return 0 <= index < len(self.manifest.chunks) and 0 <= offset < self._span(index)

    # -------------------------------------------------------------- drawing

    def batch(self, n: int) -> Batch:
        """``n`` random samples from the chunks held now."""
        if n < 1:
            raise ConfigError("n", "a batch needs at least one sample")
        if not self._held:
            raise DatasetError("No verified chunk is usable yet; wait until the sampler is ready.")
        picks = self._rng.choice(len(self._held), size=n, p=self._weights)
        provenance = []
        for k in picks:
            index = self._held[int(k)]
            provenance.append((index, int(self._rng.integers(0, self._span(index)))))
        return self._gather(provenance, self._chunks)

    def rebuild(self, provenance: list[tuple[int, int]]) -> Batch:
        """The batch made of these samples, from this sampler's chunks (loading any not yet held)."""
        for index, _ in provenance:
            self.add_chunk(index)
        return self._gather(provenance, self._chunks)

    @staticmethod
    def take(
        provenance: list[tuple[int, int]],
        manifest: DatasetManifest,
        data_dir: str | os.PathLike,
        seq_len: int | None = None,
    ) -> Batch:
        """Rebuild a batch from its provenance without a live sampler (a reference run uses this)."""
        return Sampler(manifest, data_dir, seed=0, seq_len=seq_len).rebuild(provenance)

    def _gather(self, provenance: list[tuple[int, int]], chunks: dict[int, np.ndarray]) -> Batch:
        if not provenance:
            raise ConfigError("provenance", "a batch needs at least one sample")
        for index, offset in provenance:
            if index not in chunks or not 0 <= offset < self._span(index):
                raise DatasetError(f"Sample ({index}, {offset}) is not in data set {self.manifest.name!r}.")
        if self.manifest.kind == "tokens":
            assert self.seq_len is not None
            w = np.stack([chunks[i][o : o + self.seq_len + 1] for i, o in provenance]).astype(np.int64)
            return Batch(x=w[:, :-1], y=w[:, 1:], provenance=list(provenance))
        rows = np.empty(len(provenance), dtype=next(iter(chunks.values())).dtype)
        for k, (i, o) in enumerate(provenance):
            rows[k] = chunks[i][o]
        y = rows["y"].copy() if self.manifest.label_dtype is not None else None
        return Batch(x=rows["x"].copy(), y=y, provenance=list(provenance))
