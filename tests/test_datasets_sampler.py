"""The sampler: only verified chunks, seeded draws, windows split into x/y, replay from provenance."""

from __future__ import annotations

import numpy as np
import pytest

from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.sampler import Sampler
from crowdtrain.protocol.errors import ConfigError, DatasetError

KiB = 1024


@pytest.fixture
def token_set(tmp_path):
    ids = (np.arange(40_000) % 251).astype(np.uint8)  # token value = position mod 251: windows are checkable
    np.save(tmp_path / "ids.npy", ids)
    return make_dataset(tmp_path / "ids.npy", tmp_path / "ds", chunk_bytes=8 * KiB), tmp_path / "ds", ids


def test_not_ready_until_a_chunk_is_added(token_set):
    manifest, data, _ = token_set
    s = Sampler(manifest, data, seed=1, seq_len=16)
    assert not s.ready
    with pytest.raises(DatasetError, match="No verified chunk is usable yet"):
        s.batch(4)
    s.add_chunk(2)
    assert s.ready and s.held == {2}


def test_token_windows_come_only_from_held_chunks_and_shift_by_one(token_set):
    manifest, data, ids = token_set
    s = Sampler(manifest, data, seed=7, seq_len=32)
    s.add_chunk(1)
    s.add_chunk(3)
    starts = np.cumsum([0] + [c.samples for c in manifest.chunks])
    b = s.batch(64)
    assert b.x.shape == b.y.shape == (64, 32) and b.x.dtype == np.int64
    assert np.array_equal(b.x[:, 1:], b.y[:, :-1])
    for row, (chunk, offset) in zip(b.x, b.provenance, strict=True):
        assert chunk in (1, 3)
        assert 0 <= offset <= manifest.chunks[chunk].samples - 33
        assert np.array_equal(row, ids[starts[chunk] + offset : starts[chunk] + offset + 32])
    assert {c for c, _ in b.provenance} == {1, 3}


def test_same_seed_same_batches_and_replay_from_provenance(token_set):
    manifest, data, _ = token_set
    a, b = (Sampler(manifest, data, seed=3, seq_len=8) for _ in range(2))
    for s in (a, b):
        s.add_chunk(0)
    first = a.batch(5)
    assert first.provenance == b.batch(5).provenance
    a.add_chunk(4)  # the sampler grows as chunks arrive
    grown = a.batch(50)
    again = Sampler.take(grown.provenance, manifest, data, seq_len=8)
    assert np.array_equal(again.x, grown.x) and np.array_equal(again.y, grown.y)
    assert Sampler(manifest, data, seed=4, seq_len=8).rebuild(first.provenance).provenance == first.provenance


def test_a_tampered_chunk_file_is_refused(token_set):
    manifest, data, _ = token_set
    path = data / manifest.chunks[1].name
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    s = Sampler(manifest, data, seed=0, seq_len=8)
    with pytest.raises(DatasetError, match="does not match the sha256 in the manifest"):
        s.add_chunk(1)
    assert not s.ready


def test_arrays_batches_carry_labels(tmp_path):
    x = np.arange(500 * 3, dtype=np.float32).reshape(500, 3)
    y = np.arange(500, dtype=np.int64)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    m = make_dataset(tmp_path / "xy.npz", tmp_path / "ds", chunk_bytes=4 * KiB)
    s = Sampler(m, tmp_path / "ds", seed=0)
    s.add_chunk(len(m.chunks) - 1)
    b = s.batch(10)
    assert b.x.shape == (10, 3) and b.y.shape == (10,)
    assert np.array_equal(b.x[:, 0], b.y.astype(np.float32) * 3)  # each row still sits beside its label
    assert all(c == len(m.chunks) - 1 for c, _ in b.provenance)


def test_config_errors_name_the_field(token_set):
    manifest, data, _ = token_set
    with pytest.raises(ConfigError, match="seq_len"):
        Sampler(manifest, data, seed=0)
    s = Sampler(manifest, data, seed=0, seq_len=4)
    with pytest.raises(DatasetError, match="outside data set"):
        s.add_chunk(999)


def test_seq_len_longer_than_every_chunk_is_refused(token_set):
    manifest, data, _ = token_set
    with pytest.raises(ConfigError, match="longer than every chunk"):
        Sampler(manifest, data, seed=0, seq_len=10 * KiB)
