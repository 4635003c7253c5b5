"""Issue 25 point 7, tokenizers: `dataset make --train-bpe N` / `--tokenizer FILE` cut text into a tokenizer's
ids and ship the tokenizer with the data set, the run (tracker route) and the export."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sqlite3
import sys
import sysconfig
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest

from crowdtrain.commands.export import export_state
from crowdtrain.commands.run import load_spec
from crowdtrain.datasets.make import make_dataset
from crowdtrain.datasets.session import SessionConfig, TorrentSession
from crowdtrain.datasets.torrent import read_dataset_info
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import ConfigError, DatasetError, TrackerError
from crowdtrain.protocol.messages import TokenizerInfo, replace
from crowdtrain.publisher import build_run_create
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from crowdtrain.tracker.store import Store
from tests.harness import TINY_GPT, Published, cli, until, volunteers
from tests.sim import make_run_create
from tests.test_layers import layer_imports

tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.timeout(180)
VOCAB = 512
CHUNK = 16 * 1024


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """A small folder of real text: a few of the standard library's modules (about 200 KB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    folder = tmp_path_factory.mktemp("text") / "corpus"
    folder.mkdir()
    size = 0
    for p in sorted(root.glob("*.py")):
        if 2_000 < p.stat().st_size < 40_000 and size < 200_000:
            text = p.read_bytes()
            text.decode("utf-8")
            (folder / p.name).write_bytes(text)
            size += len(text)
    return folder


def token_ids(folder: Path) -> np.ndarray:
    manifest = read_dataset_info(folder).manifest
    return np.concatenate([np.load(folder / c.name, allow_pickle=False) for c in manifest.chunks])


def documents(text_dir: Path) -> list[str]:
    return [p.read_text() for p in sorted(text_dir.iterdir())]


async def test_train_bpe_gives_the_same_bytes_twice_and_its_ids_decode_back_to_the_text(
    text_dir, tmp_path, cli_env
):
    here = await asyncio.to_thread(make_dataset, text_dir, tmp_path / "a", chunk_bytes=CHUNK, train_bpe=VOCAB)
    # the same input and options in another process (the CLI): the same bytes and info-hash
    out = await cli(
        cli_env, "dataset", "make", str(text_dir), "--out", str(tmp_path / "b"), "--train-bpe", str(VOCAB),
        "--chunk-size", "16KiB",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    a, b = read_dataset_info(tmp_path / "a"), read_dataset_info(tmp_path / "b")
    assert a.infohash == b.infohash and a.manifest == b.manifest == here
    for name in ["tokenizer.json", "manifest.json"] + [c.name for c in here.chunks]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert f"tokenizer {tmp_path / 'b' / 'tokenizer.json'} (vocabulary {VOCAB}, uint16 ids" in out.stdout

    # uint16 ids below the vocabulary, named with the tokenizer in the manifest
    data = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert here.dtype == "uint16" and here.tokenizer == TokenizerInfo(
        sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), vocab_size=VOCAB
    )
    ids = token_ids(tmp_path / "a")
    assert ids.dtype == np.uint16 and int(ids.max()) < VOCAB and len(ids) == here.total_samples
    # each document, then <|endoftext|> (id 0); they decode back to the text, byte for byte
    tok = tokenizers.Tokenizer.from_str(data.decode())
    assert tok.token_to_id("<|endoftext|>") == 0
    texts = tok.decode(ids.tolist(), skip_special_tokens=False).split("<|endoftext|>")
    assert texts == [*documents(text_dir), ""]
    assert len(ids) < 0.8 * sum(len(t.encode()) for t in texts)  # BPE: fewer tokens than bytes

    info = await cli(cli_env, "dataset", "info", str(tmp_path / "a"))
    assert f"tokenizer  tokenizer.json (vocabulary {VOCAB}, uint16 ids" in info.stdout


async def test_a_given_tokenizer_is_used_as_it_is_and_ships_unchanged(text_dir, tmp_path):
    # a tokenizer of someone else's: a BPE with BERT's template ([CLS] text [SEP]) and a model's truncation
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(documents(text_dir), trainer=trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tok.enable_truncation(max_length=16)
    path = tmp_path / "theirs.json"
    tok.save(str(path))
    source = tmp_path / "docs.jsonl"
    docs = ["def f(x): return x + 1", "", "class A:\n    pass\n" * 20]
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    manifest = make_dataset(source, tmp_path / "out", chunk_bytes=CHUNK, tokenizer=path)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()
    assert manifest.tokenizer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest.tokenizer.vocab_size == tok.get_vocab_size() and manifest.dtype == "uint16"
    # each document as the tokenizer encodes it, whole (no truncation), [SEP] already closing it
    tok.no_truncation()
    want = [i for d in docs if d for i in tok.encode(d).ids]
    assert token_ids(tmp_path / "out").tolist() == want and len(tok.encode(docs[2]).ids) > 16

    # a vocabulary beyond uint16: uint32 ids
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.txt").write_text("w1 w69999 nope w65536")
    wide = make_dataset(
        tmp_path / "big", tmp_path / "wide", chunk_bytes=CHUNK, tokenizer=tmp_path / "big.json"
    )
    assert wide.dtype == "uint32" and wide.tokenizer.vocab_size == 70_001
    assert token_ids(tmp_path / "wide").tolist() == [1, 69_999, 70_000, 65_536]


async def test_refusals_are_one_sentence(text_dir, tmp_path, cli_env, monkeypatch):
    # the library is not installed
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
        with pytest.raises(DatasetError) as missing:
            make_dataset(text_dir, tmp_path / "x", train_bpe=VOCAB)
    assert str(missing.value) == "--train-bpe needs the tokenizers library: pip install 'crowdtrain[text]'"
    # a file that is no tokenizer
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": 3}')
    out = await cli(
        cli_env, "dataset", "make", str(text_dir), "--out", str(tmp_path / "y"), "--tokenizer", str(bad)
    )
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: {bad} is not a tokenizer the tokenizers library can load (")
    # tokens already, or a vocabulary out of range
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(DatasetError, match=r"^--train-bpe tokenizes text, but .* holds arrays or token ids"):
        make_dataset(tmp_path / "ids.npy", tmp_path / "z", train_bpe=VOCAB)
    out = await cli(
        cli_env, "dataset", "make", str(text_dir), "--out", str(tmp_path / "y"), "--train-bpe", "100"
    )
    assert out.returncode == 2 and "must be a vocabulary of 257 to 65536 tokens, not 100" in out.stderr

    # a tokenizer.json changed after `dataset make`: `run create` refuses it (sha256)
    data = tmp_path / "data"
    make_dataset(text_dir, data, chunk_bytes=CHUNK, train_bpe=VOCAB)
    real = (data / "tokenizer.json").read_bytes()
    (data / "tokenizer.json").write_bytes(real.replace(b'"<|endoftext|>"', b'"<|endoftext!>"', 1))
    spec = tmp_path / "run.toml"
    spec.write_text(
        'name = "bpe"\ntarget_batch_size = 16\n[model]\nrecipe = "tiny-gpt"\nparam_hash = "' + "ab" * 32
        + '"\n[dataset]\ndir = "data"\n'
    )  # fmt: skip
    with pytest.raises(ConfigError) as changed:
        load_spec(spec)
    assert str(changed.value) == (
        f"dataset.dir: {data / 'tokenizer.json'} is not the tokenizer its manifest names (its sha256 differs); "
        "it changed after `dataset make`: run `dataset make` again"
    )
    (data / "tokenizer.json").write_bytes(real)
    assert base64.b64decode(load_spec(spec).tokenizer) == real
    spec.write_text(spec.read_text().replace("[model]", 'tokenizer = "e30="\n[model]'))
    with pytest.raises(ConfigError, match=r"tokenizer is not a run-spec key"):
        load_spec(spec)


async def published(tracker, data: Path, **settings) -> Published:
    create = await asyncio.to_thread(
        build_run_create,
        data,
        name="bpe run",
        model={"recipe": "tiny-gpt", "args": {**TINY_GPT, "vocab": VOCAB}},
        target_batch_size=16,
        micro_batch_size=8,
        optimizer={"name": "adamw", "lr": 3e-3},
        schedule={"kind": "constant", "warmup_steps": 0, "total_steps": 1000},
        averaging={"group_size": 4, "codec": "none", "gather_s": 1.0, "average_state_every": 0},
        **settings,
    )
    assert base64.b64decode(create.tokenizer) == (data / "tokenizer.json").read_bytes()
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as admin:
        # refused: a tokenizer that is not the manifest's, or none where the manifest names one
        real = base64.b64decode(create.tokenizer)
        other = real.replace(b"<|endoftext|>", b"<|endoftext!>", 1)  # as long, another sha256
        for wrong, text in (
            (
                base64.b64encode(b"{}").decode(),
                "RunCreate: tokenizer is 2 bytes, but dataset.manifest.tokenizer",
            ),
            (base64.b64encode(other).decode(), "RunCreate: tokenizer has sha256 "),
            (msgspec.UNSET, "RunCreate: tokenizer is missing, but dataset.manifest.tokenizer names one"),
        ):
            with pytest.raises(TrackerError) as refused:
                await admin.create_run(replace(create, tokenizer=wrong))
            assert refused.value.status == 400 and str(refused.value).startswith(text), refused.value
        spec = (await admin.create_run(create)).spec
    manifest = read_dataset_info(data).manifest
    return Published(tracker, spec, data, manifest, TorrentSession(SessionConfig()))


async def test_a_run_serves_its_tokenizer_and_export_writes_it(text_dir, tmp_path):
    data = tmp_path / "data"
    config = TrackerConfig(db=str(tmp_path / "tracker.db"), heartbeat_interval_s=0.2, peer_ttl_s=10.0)
    async with serve(config) as tracker:
        await asyncio.to_thread(
            make_dataset, text_dir, data, chunk_bytes=CHUNK, train_bpe=VOCAB, name="bpe",
            announce_url=tracker.announce_url,
        )  # fmt: skip
        real = (data / "tokenizer.json").read_bytes()
        run = await published(tracker, data)
        async with TrackerClient(tracker.url) as client:
            assert await client.get_tokenizer(run.spec.run_id) == real
        seeder = run.seeder
        await seeder.start()
        try:
            await seeder.seed(data, (data / "bpe.torrent").read_bytes(), manifest=run.manifest)
            [volunteer] = volunteers(run, tmp_path, 1)
            task = asyncio.create_task(volunteer.run())

            async def served() -> bool:
                async with TrackerClient(tracker.url) as c:
                    return (await c.donors(run.spec.run_id)).state is not None

            await until(served, 120, "the volunteer's state on offer", every_s=0.2)
            out = tmp_path / "export" / "model.safetensors"
            info = await export_state(run.spec.run_id, tracker.url, out, None, 10.0)
            volunteer.stop()
            await asyncio.wait_for(task, 60)
        finally:
            await seeder.close()
    written = (tmp_path / "export" / "tokenizer.json").read_bytes()
    assert (
        written == real and hashlib.sha256(written).hexdigest() == run.spec.dataset.manifest.tokenizer.sha256
    )
    model = json.loads((tmp_path / "export" / "model.json").read_text())
    assert (
        model["tokenizer"]
        == info["tokenizer"]
        == {
            "file": "tokenizer.json",
            "sha256": run.spec.dataset.manifest.tokenizer.sha256,
            "vocab_size": VOCAB,
        }
    )
    assert model["args"]["vocab"] == VOCAB

    # the tracker kept it through a restart
    async with serve(config) as tracker, TrackerClient(tracker.url) as client:
        assert await client.get_tokenizer(run.spec.run_id) == real


async def test_a_run_without_a_tokenizer_answers_404_and_a_private_one_serves_it_like_its_torrent(
    text_dir, tmp_path
):
    data = tmp_path / "data"
    make_dataset(text_dir, data, chunk_bytes=CHUNK, train_bpe=VOCAB)
    create = build_run_create(
        data, name="private", model={"recipe": "tiny-gpt", "args": {**TINY_GPT, "vocab": VOCAB}},
        target_batch_size=16, join_policy="token", join_token="s3cret-token",
    )  # fmt: skip
    async with (
        serve(TrackerConfig()) as tracker,
        TrackerClient(tracker.url, admin_token=tracker.admin_token) as admin,
        TrackerClient(tracker.url) as anyone,
    ):
        plain = (await admin.create_run(make_run_create())).run_id
        private = (await admin.create_run(create)).run_id
        assert await anyone.get_tokenizer(plain) is None
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{tracker.url}/api/v1/runs/{plain}/tokenizer") as none,
        ):
            assert none.status == 404 and (await none.json())["error"] == (
                f"run {plain} has no tokenizer: its data set was made without --tokenizer or --train-bpe"
            )
        assert (
            await anyone.get_torrent(private)
            == (data / f"{create.dataset.manifest.name}.torrent").read_bytes()
        )
        assert await anyone.get_tokenizer(private) == (data / "tokenizer.json").read_bytes()
        with pytest.raises(TrackerError, match="there is no run 'nope'"):
            await anyone.get_tokenizer("nope")


def test_a_database_of_an_earlier_version_gains_the_tokenizer_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, spec BLOB NOT NULL, torrent BLOB NOT NULL,"
            " join_token_hash TEXT, global_step INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL)"
        )
    db.close()
    store = Store(str(path))
    try:
        assert store.tokenizer("any") is None
        columns = {row[1] for row in store._db.execute("PRAGMA table_info(runs)")}
        assert {"tokenizer", "closed_at"} <= columns
    finally:
        store.close()


def test_the_tracker_never_imports_tokenizers():
    _, loaded = layer_imports("crowdtrain.tracker", ())
    assert "tokenizers" not in loaded


def test_a_manifest_without_a_tokenizer_keeps_its_bytes(text_dir, tmp_path):
    """No ``"tokenizer": null``: a byte-level set made now has the bytes (and info-hash) it had before."""
    manifest = make_dataset(text_dir, tmp_path / "bytes", chunk_bytes=CHUNK)
    assert b"tokenizer" not in (tmp_path / "bytes" / "manifest.json").read_bytes()
    assert not isinstance(manifest.tokenizer, TokenizerInfo) and manifest.dtype == "uint8"
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()


def test_a_manifest_whose_dtype_cannot_hold_its_tokenizers_ids_is_refused(text_dir, tmp_path):
    from crowdtrain.protocol.runcheck import check_manifest

    manifest = make_dataset(text_dir, tmp_path / "bpe", chunk_bytes=CHUNK, train_bpe=VOCAB)
    check_manifest(manifest)
    with pytest.raises(ConfigError) as narrow:
        check_manifest(replace(manifest, dtype="uint8"))
    assert str(narrow.value) == (
        f"dataset.manifest.tokenizer.vocab_size: is {VOCAB}, but uint8 tokens hold ids 0 to 255"
    )
    with pytest.raises(ConfigError, match=r"^dataset.manifest.tokenizer: belongs to a tokens data set only"):
        check_manifest(replace(manifest, kind="arrays", sample_shape=[1]))
