"""`dataset make` / `dataset info`: chunk format, sources, reproducible torrents, error sentences."""

from __future__ import annotations

import json
import re
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.datasets.chunks import load_chunk, sha256_file
from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.torrent import infohash_of, piece_size_for, read_dataset_info
from crowdtrain.protocol.errors import ConfigError, DatasetError
from crowdtrain.protocol.messages import DatasetManifest, decode

KiB = 1024


def tokens_of(out: Path, manifest: DatasetManifest) -> bytes:
    return b"".join(load_chunk(out / c.name, c, manifest).tobytes() for c in manifest.chunks)


def test_stdlib_corpus_is_reproducible_and_self_consistent(tmp_path):
    a = make_dataset("builtin:stdlib", tmp_path / "a", chunk_bytes=64 * KiB, max_bytes=300 * KiB)
    b = make_dataset("builtin:stdlib", tmp_path / "b", chunk_bytes=64 * KiB, max_bytes=300 * KiB)
    assert a == b
    assert a.kind == "tokens" and a.dtype == "uint8" and a.name == "python-stdlib"
    assert a.total_samples == 300 * KiB == sum(c.samples for c in a.chunks)
    ia, ib = read_dataset_info(tmp_path / "a"), read_dataset_info(tmp_path / "b")
    assert ia.infohash == ib.infohash and len(ia.infohash) == 40
    assert ia.piece_bytes == 64 * KiB and ia.files == len(a.chunks) + 1
    for c in a.chunks:
        assert c.bytes <= 64 * KiB and sha256_file(tmp_path / "a" / c.name) == c.sha256
    assert decode((tmp_path / "a" / "manifest.json").read_bytes(), DatasetManifest) == a
    # the tokens are the sorted standard library's bytes
    first = sorted(
        (p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if p.is_file()),
        key=lambda p: p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix(),
    )[0]
    assert tokens_of(tmp_path / "a", a).startswith(first.read_bytes()[:100])


def test_same_input_same_infohash_and_web_seed_does_not_change_it(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "b.txt").write_text("second file\n" * 500)
    (src / "a.txt").write_text("first file\n" * 500)
    make_dataset(src, tmp_path / "x", chunk_bytes=4 * KiB, announce_url="http://127.0.0.1:1/announce")
    make_dataset(
        src, tmp_path / "y", chunk_bytes=4 * KiB, announce_url="http://127.0.0.1:1/announce",
        web_seed="http://127.0.0.1:2/data/",
    )  # fmt: skip
    x, y = read_dataset_info(tmp_path / "x"), read_dataset_info(tmp_path / "y")
    assert x.infohash == y.infohash
    assert y.web_seeds == ["http://127.0.0.1:2/data/"] and x.web_seeds == []
    assert x.trackers == ["http://127.0.0.1:1/announce"]
    m = x.manifest
    assert (
        tokens_of(tmp_path / "x", m) == ("first file\n" * 500 + "\n" + "second file\n" * 500 + "\n").encode()
    )


def test_jsonl_text_field_and_max_bytes(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"body": f"doc {i} é"}) for i in range(1000)) + "\n")
    m = make_dataset(src, tmp_path / "out", chunk_bytes=4 * KiB, text_field="body")
    assert tokens_of(tmp_path / "out", m).decode().startswith("doc 0 é\ndoc 1 é\n")
    capped = make_dataset(src, tmp_path / "cap", chunk_bytes=4 * KiB, text_field="body", max_bytes=5000)
    assert capped.total_samples == 5000
    with pytest.raises(DatasetError, match="line 1 has no 'text' field; pass --text-field"):
        make_dataset(src, tmp_path / "bad", chunk_bytes=4 * KiB)


def test_npy_tokens_and_npz_supervised_arrays(tmp_path):
    ids = np.arange(10_000, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    m = make_dataset(tmp_path / "ids.npy", tmp_path / "tok", chunk_bytes=4 * KiB)
    assert m.kind == "tokens" and m.dtype == "uint16"
    got = np.concatenate([load_chunk(tmp_path / "tok" / c.name, c, m) for c in m.chunks])
    assert np.array_equal(got, ids)

    x = np.random.default_rng(0).normal(size=(300, 4, 4)).astype(np.float32)
    y = np.arange(300, dtype=np.int64) % 10
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    m = make_dataset(tmp_path / "xy.npz", tmp_path / "arr", chunk_bytes=4 * KiB)
    assert (m.kind, m.dtype, m.sample_shape, m.label_dtype, m.total_samples) == (
        "arrays", "float32", [4, 4], "int64", 300,
    )  # fmt: skip
    rows = np.concatenate([load_chunk(tmp_path / "arr" / c.name, c, m) for c in m.chunks])
    assert np.array_equal(rows["x"], x) and np.array_equal(rows["y"], y)
    assert len(m.chunks) == -(-300 // (4 * KiB // (16 * 4 + 8)))


def test_piece_size_is_a_power_of_two_at_least_16_kib():
    assert piece_size_for(4 << 20) == 4 << 20
    assert piece_size_for(3_000_000) == 2 << 20
    assert piece_size_for(4 * KiB) == 16 * KiB


# ------------------------------------------------------------------ error sentences


def test_missing_source_is_a_sentence(tmp_path):
    with pytest.raises(DatasetError, match=r"Source .*nope does not exist; give a folder of text files"):
        make_dataset(tmp_path / "nope", tmp_path / "out")


def test_empty_sources_are_sentences(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="holds no text files with content; nothing to make"):
        make_dataset(tmp_path / "empty", tmp_path / "o1")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="holds no data"):
        make_dataset(tmp_path / "e.jsonl", tmp_path / "o2")
    np.save(tmp_path / "e.npy", np.zeros((0, 3), np.float32))
    with pytest.raises(DatasetError, match="holds no samples"):
        make_dataset(tmp_path / "e.npy", tmp_path / "o3")


def test_unreadable_file_is_a_sentence(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.txt").write_text("fine\n")
    # A file the OS refuses to read even for root: /proc/self/mem answers every read with EIO.
    (src / "b.txt").symlink_to("/proc/self/mem")
    with pytest.raises(DatasetError, match=r"Cannot read .*b.txt: Input/output error; check its permissions"):
        make_dataset(src, tmp_path / "out")


def test_chunk_too_small_for_one_sample_is_a_sentence(tmp_path):
    np.savez(tmp_path / "big.npz", x=np.zeros((4, 64, 64), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(
        DatasetError,
        match=r"A chunk of 8192 bytes cannot hold one sample of 16392 bytes .* larger --chunk-size",
    ):
        make_dataset(tmp_path / "big.npz", tmp_path / "out", chunk_bytes=8 * KiB)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        make_dataset(tmp_path / "big.npz", tmp_path / "out", chunk_bytes=100)


def test_out_dir_with_foreign_files_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("precious")
    with pytest.raises(DatasetError, match="already holds files that are not a data set"):
        make_dataset("builtin:stdlib", tmp_path / "out", max_bytes=10 * KiB)
    assert (tmp_path / "out" / "thesis.tex").exists()


@pytest.mark.parametrize(
    ("name", "save", "sentence"),
    [
        ("arrays.npy", np.savez, r"arrays\.npy is an \.npz archive of arrays, not one array; name it \.npz"),
        ("array.npz", np.save, r"array\.npz holds one array, not an \.npz archive of x and y; name it \.npy"),
    ],
)
def test_a_numpy_file_named_as_the_other_kind_is_a_sentence_not_a_crash(tmp_path, name, save, sentence):
    """np.load reads a file by its bytes, not its name: an .npz archive named .npy made `dataset make` fail
    with an AttributeError, and one array named .npz with a TypeError, instead of saying what to rename."""
    with (tmp_path / name).open("wb") as f:  # a file object: np.save and np.savez add no suffix to it
        save(f, np.zeros((4, 3), np.float32))
    with pytest.raises(DatasetError, match=sentence):
        make_dataset(tmp_path / name, tmp_path / "out", chunk_bytes=4 * KiB)


@pytest.mark.parametrize(
    "garbage", [b"", b"garbage", b"d4:infoi1ee", b"d4:infod4:name3:abcee", b"l" * 100_000]
)
def test_garbage_torrents_are_clear_errors(tmp_path, garbage):
    with pytest.raises(DatasetError, match=r"not a valid \.torrent"):
        infohash_of(garbage)
    (tmp_path / "x.torrent").write_bytes(garbage)
    with pytest.raises(DatasetError, match=r"x.torrent: This is not a valid .torrent"):
        read_dataset_info(tmp_path / "x.torrent")


def test_info_on_folder_without_manifest(tmp_path):
    with pytest.raises(DatasetError, match=r"has no manifest\.json"):
        read_dataset_info(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("samples", -5, "manifest.chunks[0].samples"),
        ("name", "../../evil.npy", "manifest.chunks[0].name"),
        ("sha256", "nothex", "manifest.chunks[0].sha256"),
    ],
)
def test_info_checks_every_manifest_field_as_a_volunteer_would(tmp_path, field, value, named):
    """Issue 16: `dataset info` accepted a manifest with ``samples = -5``; it checks what the tracker and a
    volunteer check (protocol/runcheck.py) and names the field."""
    make_dataset("builtin:stdlib", tmp_path / "ds", chunk_bytes=64 * KiB, max_bytes=128 * KiB)
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["chunks"][0][field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=re.escape(named)):
        read_dataset_info(tmp_path / "ds")


# ------------------------------------------------------------------ the command line


def run_cli(python, env, *args):
    return subprocess.run(
        [python, "-m", "crowdtrain", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_cli_make_and_info(python, cli_env, tmp_path):
    out = run_cli(
        python, cli_env, "dataset", "make", "builtin:stdlib", "--out", str(tmp_path / "ds"),
        "--chunk-size", "64KiB", "--max-bytes", "200KiB", "--tracker", "http://127.0.0.1:7/", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert (
        made["trackers"] == ["http://127.0.0.1:7/announce"] and made["manifest"]["total_samples"] == 200 * KiB
    )
    out = run_cli(python, cli_env, "dataset", "info", str(tmp_path / "ds" / "python-stdlib.torrent"))
    assert out.returncode == 0, out.stderr
    assert f"info-hash  {made['infohash']}" in out.stdout


def test_info_counts_tokens_of_a_tokens_data_set_and_samples_of_arrays(tmp_path):
    """Issue 25: `dataset info` called a tokens data set's token count "samples"."""
    from typer.testing import CliRunner

    from crowdtrain.cli import app

    np.save(tmp_path / "ids.npy", np.arange(5_000, dtype=np.uint16))
    make_dataset(tmp_path / "ids.npy", tmp_path / "tok", chunk_bytes=4 * KiB)
    np.savez(tmp_path / "xy.npz", x=np.zeros((300, 4), np.float32), y=np.zeros(300, np.int64))
    make_dataset(tmp_path / "xy.npz", tmp_path / "arr", chunk_bytes=4 * KiB)
    runner = CliRunner()
    tokens = runner.invoke(app, ["dataset", "info", str(tmp_path / "tok")])
    arrays = runner.invoke(app, ["dataset", "info", str(tmp_path / "arr")])
    assert tokens.exit_code == arrays.exit_code == 0, (tokens.output, arrays.output)
    assert "\ntokens     5000\n" in tokens.output + "\n" and "samples" not in tokens.output
    assert "\nsamples    300\n" in arrays.output + "\n" and "tokens" not in arrays.output
    # --json keeps the manifest's field names
    as_json = json.loads(runner.invoke(app, ["dataset", "info", str(tmp_path / "tok"), "--json"]).output)
    assert as_json["manifest"]["total_samples"] == 5000


def test_cli_errors_are_sentences_with_exit_1(python, cli_env, tmp_path):
    out = run_cli(python, cli_env, "dataset", "make", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert out.returncode == 1
    assert out.stderr.startswith("error: Source ") and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_cli(
        python,
        cli_env,
        "dataset",
        "make",
        "builtin:stdlib",
        "--out",
        str(tmp_path / "o"),
        "--chunk-size",
        "lots",
    )
    assert out.returncode == 2 and "is not a size" in out.stderr


def test_datasets_import_only_protocol_libtorrent_and_numpy(python):
    code = (
        "import sys, crowdtrain.datasets.make, crowdtrain.datasets.session, crowdtrain.datasets.sampler;"
        "print('\\n'.join(sys.modules))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(out.stdout.split())
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & {"torch", "aiohttp", "rich", "typer"}, sorted(
        roots & {"torch", "aiohttp", "rich", "typer"}
    )
    assert not {m for m in loaded if m.startswith(("crowdtrain.volunteer", "crowdtrain.tracker"))}


def test_progress_reports_monotonic_bytes_up_to_the_total(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2000, 8), np.float32))  # an N-D .npy: an arrays set without labels
    seen: list[tuple[int, int]] = []
    m = make_dataset(
        tmp_path / "x.npy", tmp_path / "out", chunk_bytes=8 * KiB, progress=lambda d, t: seen.append((d, t))
    )
    assert (m.kind, m.label_dtype, m.sample_shape, m.total_samples) == ("arrays", None, [8], 2000)
    done = [d for d, _ in seen]
    assert done == sorted(done) and seen[-1] == (2000 * 32, 2000 * 32)
