"""``crowdtrain dataset make|info|seed``: turn a source into chunks and a torrent, describe it, seed it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from crowdtrain.commands.common import run_async, wants_json
from crowdtrain.protocol.errors import ConfigError, DatasetError
from crowdtrain.protocol.messages import TokenizerInfo

if TYPE_CHECKING:
    from rich.progress import Progress

    from crowdtrain.datasets.torrent import DatasetInfo
    from crowdtrain.protocol.messages import DatasetManifest

app = typer.Typer(help="Make, inspect and seed BitTorrent data sets.", no_args_is_help=True)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}  # fmt: skip


def parse_size(text: str, option: str) -> int:
    """``4MiB``, ``256KiB``, ``1000000`` → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(
            f"{text!r} is not a size; write e.g. 4MiB, 256KiB or 1000000", param_hint=option
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def announce_url_of(tracker: str) -> str:
    tracker = tracker.rstrip("/")
    return tracker if tracker.endswith("/announce") else tracker + "/announce"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _counted(kind: str) -> str:
    """What a manifest's ``total_samples`` counts: tokens for a tokens data set, samples for arrays."""
    return "tokens" if kind == "tokens" else "samples"


@app.command("make")
def make(
    ctx: typer.Context,
    source: str = typer.Argument(
        ..., help="A folder of text files, a .jsonl, .npy or .npz file, or builtin:stdlib (the demo corpus)."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Folder to write the chunks, manifest and torrent into."
    ),
    chunk_size: str = typer.Option("4MiB", "--chunk-size", help="Bytes per chunk file (e.g. 4MiB, 256KiB)."),
    name: str | None = typer.Option(None, "--name", help="Data set name (default: from the source)."),
    tracker: str | None = typer.Option(
        None, "--tracker", help="Tracker URL; its /announce goes in the torrent."
    ),
    web_seed: str | None = typer.Option(None, "--web-seed", help="HTTP base URL serving the files (BEP 19)."),
    text_field: str = typer.Option("text", "--text-field", help="Field holding the text in a .jsonl source."),
    max_bytes: str | None = typer.Option(None, "--max-bytes", help="Stop after this much data (e.g. 4MiB)."),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="Cut text into the ids of this tokenizer.json (Hugging Face tokenizers); it ships with the data.",
    ),
    train_bpe: int | None = typer.Option(
        None,
        "--train-bpe",
        help="Train a byte-level BPE of this many tokens (257-65536) on the text and cut the text with it.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Cut SOURCE into chunk files, write manifest.json and a v1 .torrent."""
    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.datasets.torrent import read_dataset_info

    chunk_bytes = parse_size(chunk_size, "--chunk-size")
    cap = parse_size(max_bytes, "--max-bytes") if max_bytes else None
    _check_tokenizer_options(tokenizer, train_bpe)
    as_json = wants_json(ctx, json_out)
    with _progress_bar(hidden=as_json) as bar:
        task = bar.add_task("chunking", total=None)
        manifest = make_dataset(
            source,
            out,
            chunk_bytes=chunk_bytes,
            name=name,
            announce_url=announce_url_of(tracker) if tracker else None,
            web_seed=web_seed,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            text_field=text_field,
            max_bytes=cap,
            tokenizer=tokenizer,
            train_bpe=train_bpe,
        )
    info = read_dataset_info(out)
    if as_json:
        typer.echo(json.dumps(info.to_dict()))
        return
    typer.echo("\n".join(_made_lines(manifest, info, out)))


def _check_tokenizer_options(tokenizer: Path | None, train_bpe: int | None) -> None:
    """--tokenizer with --train-bpe, or a BPE vocabulary outside what the chunks hold, is a usage error (exit 2)
    before any input is read."""
    from crowdtrain.datasets.make import BPE_MAX_VOCAB, BPE_MIN_VOCAB

    if tokenizer is not None and train_bpe is not None:
        raise typer.BadParameter("give --tokenizer FILE or --train-bpe N, not both", param_hint="--train-bpe")
    if train_bpe is not None and not BPE_MIN_VOCAB <= train_bpe <= BPE_MAX_VOCAB:
        raise typer.BadParameter(
            f"must be a vocabulary of {BPE_MIN_VOCAB} to {BPE_MAX_VOCAB} tokens, not {train_bpe}",
            param_hint="--train-bpe",
        )


def _progress_bar(hidden: bool) -> Progress:
    """A bar on stderr of the source's bytes read; none for --json or where stderr is no terminal."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        transient=True, disable=hidden or not sys.stderr.isatty(),
    )  # fmt: skip


def _made_lines(manifest: DatasetManifest, info: DatasetInfo, out: Path) -> list[str]:
    """What `dataset make` says it made: the data set, its info-hash, torrent and tokenizer."""
    lines = [
        f"made data set {manifest.name!r}: {len(manifest.chunks)} chunks, {manifest.total_samples} "
        f"{_counted(manifest.kind)}, {_human(info.total_bytes)}",
        f"  info-hash {info.infohash}",
        f"  torrent   {info.torrent_path}",
    ]
    if isinstance(manifest.tokenizer, TokenizerInfo):
        lines.append(f"  tokenizer {out / 'tokenizer.json'} ({_tokenizer_line(manifest)})")
    return lines


def _tokenizer_line(m) -> str:
    t = m.tokenizer
    return f"vocabulary {t.vocab_size}, {m.dtype} ids, {_human(t.bytes)}, sha256 {t.sha256}"


@app.command("info")
def info(
    ctx: typer.Context,
    path: Path = typer.Argument(..., help="A data set folder or a .torrent file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print what a data set folder or .torrent holds."""
    from crowdtrain.datasets.torrent import read_dataset_info

    ds = read_dataset_info(path)
    if wants_json(ctx, json_out):
        typer.echo(json.dumps(ds.to_dict()))
        return
    lines = [
        f"name       {ds.name}",
        f"info-hash  {ds.infohash}",
        f"files      {ds.files} ({_human(ds.total_bytes)}), {ds.pieces} pieces of {_human(ds.piece_bytes)}",
        f"trackers   {', '.join(ds.trackers) or '(none)'}",
        f"web seeds  {', '.join(ds.web_seeds) or '(none)'}",
    ]
    if ds.manifest is not None:
        m = ds.manifest
        layout = m.dtype if m.kind == "tokens" else f"x {m.dtype}{m.sample_shape}, y {m.label_dtype}"
        lines += [
            f"kind       {m.kind} ({layout})",
            f"chunks     {len(m.chunks)} of up to {_human(m.chunk_bytes)}",
            # a tokens data set's total_samples counts tokens (a sample is cut from them by the recipe)
            f"{_counted(m.kind):<10} {m.total_samples}",
        ]
        if isinstance(m.tokenizer, TokenizerInfo):
            lines.append(f"tokenizer  tokenizer.json ({_tokenizer_line(m)})")
    typer.echo("\n".join(lines))


@app.command("seed")
def seed(
    ctx: typer.Context,
    data_dir: Path = typer.Argument(..., help="A folder made by `dataset make` (or fully downloaded)."),
    tracker: str | None = typer.Option(
        None, "--tracker", help="The tracker that serves this data set's swarm (checked before seeding)."
    ),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        envvar="CROWDTRAIN_ADMIN_TOKEN",
        help="The tracker's admin token: registers the data set there. Not needed where the tracker "
        "already serves it (a run uses it, it was registered, or the tracker runs with --open).",
    ),
    host: str = typer.Option("0.0.0.0", "--host", help="Interface to accept peers on (default: every one)."),
    bt_port: int = typer.Option(0, "--bt-port", help="TCP port of BitTorrent; 0: any free (printed)."),
    upload_limit: str = typer.Option("0", "--upload-limit", help="Upload rate limit per second (0 = none)."),
    json_out: bool = typer.Option(False, "--json", help="Print stats as JSON lines."),
) -> None:
    """Seed a data set until Ctrl-C, showing peers and upload rate."""
    from crowdtrain.datasets.session import SessionConfig, listen_address

    if not 0 <= bt_port <= 65535:
        raise typer.BadParameter("must be between 0 and 65535", param_hint="--bt-port")
    try:
        cfg = SessionConfig(
            listen=listen_address(host, bt_port), upload_rate_limit=parse_size(upload_limit, "--upload-limit")
        )
    except ConfigError as exc:
        hint = "--host" if exc.field == "listen" else f"--{exc.field.replace('_', '-')}"
        raise typer.BadParameter(exc.problem, param_hint=hint) from None
    run_async(_seed(data_dir, tracker, admin_token, cfg, wants_json(ctx, json_out)))


async def _seed(data_dir: Path, tracker: str | None, admin_token: str | None, cfg, as_json: bool) -> None:
    from rich.console import Console
    from rich.live import Live

    from crowdtrain.datasets.session import TorrentSession
    from crowdtrain.datasets.torrent import find_torrent, read_dataset_info

    ds = read_dataset_info(data_dir)
    if ds.manifest is None:
        raise DatasetError(f"{data_dir} has no manifest; give the folder made by `dataset make`.")
    if tracker and admin_token:
        await _register(tracker, admin_token, ds.infohash, ds.name)
    elif tracker:
        await _check_served(tracker, ds.infohash, ds.name)
    torrent_bytes = find_torrent(data_dir).read_bytes()
    async with TorrentSession(cfg) as ses:
        dl = await ses.seed(data_dir, torrent_bytes, manifest=ds.manifest)
        head = f"seeding {ds.name} ({ds.infohash}) on port {ses.listen_port}"
        console = Console()
        if as_json:
            event = {"event": "Seeding", "name": ds.name, "infohash": ds.infohash, "port": ses.listen_port}
            typer.echo(json.dumps(event))
        elif not console.is_terminal:
            typer.echo(head)
        live = Live(console=console, transient=True) if console.is_terminal and not as_json else None
        with live or contextlib.nullcontext():
            for tick in itertools.count():
                st = dl.stats()
                line = f"{st.peers} peer(s), up {_human(st.upload_rate)}/s, sent {_human(st.uploaded)}"
                if as_json:
                    stats = {"event": "TorrentStats", "peers": st.peers, "upload_rate": st.upload_rate,
                             "uploaded": st.uploaded, "chunks": st.chunks_total}  # fmt: skip
                    typer.echo(json.dumps(stats))
                elif live is not None:
                    live.update(f"{head}\n{line} (Ctrl-C to stop)", refresh=True)
                elif tick % 10 == 0:  # no terminal: a line every 10 s
                    typer.echo(line)
                await asyncio.sleep(1.0)


async def _check_served(tracker: str, infohash: str, name: str) -> None:
    """Without an admin token nothing is registered: make sure the tracker serves this swarm already."""
    from crowdtrain.protocol.client import TrackerClient

    async with TrackerClient(tracker) as client:
        served = await client.serves_infohash(infohash)
    if not served:
        raise DatasetError(
            f"the tracker at {tracker} does not serve data set {name!r} ({infohash}): no run uses it, it was "
            "not registered and the tracker does not run with --open; pass --admin-token to register it"
        )


async def _register(tracker: str, admin_token: str, infohash: str, name: str) -> None:
    """Tell the tracker this info-hash is a data set, so its /announce serves the swarm."""
    from crowdtrain.protocol.client import TrackerClient

    async with TrackerClient(tracker, admin_token=admin_token) as client:
        await client.register_dataset(infohash, name)
