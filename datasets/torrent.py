"""Torrents of data sets: creation (v1 only, reproducible), info-hash, and ``dataset info``.

The torrent's root folder is the data set's name; its files are the chunks in index order followed by
``manifest.json``, so file index ``i`` is chunk ``i``. The piece size is the chunk size rounded down to a
power of two (at least 16 KiB, as BitTorrent requires), which lets a peer finish its first chunk after one
or two pieces. Piece hashes are computed here (SHA-1 over the concatenated files), so the torrent does not
depend on the folder's name, and no creation date is written: the same data gives the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import libtorrent as lt

from crowdtrain.datasets.chunks import MANIFEST_NAME
from crowdtrain.protocol.errors import ConfigError, DatasetError, ProtocolError
from crowdtrain.protocol.limits import MAX_TORRENT_BYTES
from crowdtrain.protocol.messages import DatasetManifest, decode
from crowdtrain.protocol.runcheck import check_manifest, check_text

MIN_PIECE = 16 << 10


def piece_size_for(chunk_bytes: int) -> int:
    """The largest power of two ≤ ``chunk_bytes``, at least 16 KiB."""
    return max(MIN_PIECE, 1 << (max(1, chunk_bytes).bit_length() - 1))


def torrent_files(manifest: DatasetManifest) -> list[str]:
    """File names in torrent order: the chunks by index, then the manifest."""
    return [c.name for c in manifest.chunks] + [MANIFEST_NAME]


def _check_url(field: str, url: str, *, announce: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(field, f"{url!r} is not an http(s) URL")
    if announce and not parts.path.endswith("/announce"):
        raise ConfigError(
            field, f"{url!r} must end in /announce (libtorrent refuses other tracker paths on loopback)"
        )
    if not announce and parts.query:
        raise ConfigError(
            field, f"{url!r} must carry no query string (BEP 19 web seeds append the file path)"
        )


def build_torrent(
    data_dir: Path, manifest: DatasetManifest, *, announce_url: str | None = None, web_seed: str | None = None
) -> bytes:
    """The bencoded v1 torrent of the data set whose files are in ``data_dir``."""
    if announce_url:
        _check_url("announce_url", announce_url, announce=True)
    if web_seed:
        _check_url("web_seed", web_seed, announce=False)
    names = torrent_files(manifest)
    paths = [data_dir / n for n in names]
    try:
        sizes = [p.stat().st_size for p in paths]
    except OSError as exc:
        raise DatasetError(f"Cannot read {exc.filename}: {exc.strerror}; run `dataset make` again.") from None
    piece = piece_size_for(manifest.chunk_bytes)
    entries = [lt.create_file_entry(f"{manifest.name}/{n}", s) for n, s in zip(names, sizes, strict=True)]
    ct = lt.create_torrent(entries, piece, lt.create_torrent.v1_only)
    index, buf = 0, bytearray()
    for p in paths:
        with p.open("rb") as f:
            while block := f.read(piece - len(buf)):
                buf += block
                if len(buf) == piece:
                    ct.set_hash(index, hashlib.sha1(buf).digest())
                    index, buf = index + 1, bytearray()
    if buf:
        ct.set_hash(index, hashlib.sha1(buf).digest())
        index += 1
    if index != ct.num_pieces():
        raise DatasetError(
            f"Files in {data_dir} changed while the torrent was made; run `dataset make` again."
        )
    if announce_url:
        ct.add_tracker(announce_url)
    if web_seed:
        ct.add_url_seed(web_seed)
    ct.set_creator("crowdtrain")
    return lt.bencode(ct.generate())


def write_torrent(
    data_dir: Path, manifest: DatasetManifest, *, announce_url: str | None = None, web_seed: str | None = None
) -> Path:
    path = data_dir / f"{manifest.name}.torrent"
    path.write_bytes(build_torrent(data_dir, manifest, announce_url=announce_url, web_seed=web_seed))
    return path


def parse_torrent(torrent_bytes: bytes) -> lt.torrent_info:
    """Parse a .torrent, bounded; garbage becomes a :class:`DatasetError` sentence."""
    if len(torrent_bytes) > MAX_TORRENT_BYTES:
        raise DatasetError(
            f"The torrent is {len(torrent_bytes)} bytes, more than the {MAX_TORRENT_BYTES >> 20} MiB a data set "
            "torrent may have; it is not a crowdtrain torrent."
        )
    try:
        return lt.torrent_info(bytes(torrent_bytes))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise DatasetError(f"This is not a valid .torrent file ({exc}).") from None


def infohash_of(torrent_bytes: bytes) -> str:
    """The v1 info-hash, 40 lowercase hex characters."""
    ti = parse_torrent(torrent_bytes)
    if not ti.info_hashes().has_v1():
        raise DatasetError("The torrent has no v1 info-hash; crowdtrain data sets are v1 torrents.")
    return str(ti.info_hashes().v1)


def check_torrent_matches(torrent_bytes: bytes, manifest: DatasetManifest) -> lt.torrent_info:
    """Parse the torrent and check its files are the manifest's chunks (names and sizes), in order."""
    ti = parse_torrent(torrent_bytes)
    fs = ti.layout()
    want = torrent_files(manifest)
    got = [os.path.basename(fs.file_path(i)) for i in range(fs.num_files())]
    if got[: len(manifest.chunks)] != want[: len(manifest.chunks)] or len(got) != len(want):
        raise DatasetError(
            f"The torrent's files do not match the manifest of data set {manifest.name!r}; "
            "they were not made together."
        )
    for i, c in enumerate(manifest.chunks):
        if fs.file_size(i) != c.bytes:
            raise DatasetError(
                f"The torrent says {c.name} is {fs.file_size(i)} bytes but the manifest says {c.bytes}; "
                "they were not made together."
            )
    return ti


def read_manifest(path: Path) -> DatasetManifest:
    try:
        data = path.read_bytes() if path.stat().st_size <= (1 << 20) else None
    except OSError as exc:
        raise DatasetError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    if data is None:
        raise DatasetError(f"{path} is larger than 1 MiB; it is not a crowdtrain manifest.")
    try:
        manifest = decode(data, DatasetManifest)
    except ProtocolError as exc:
        raise DatasetError(f"{path} is not a valid data set manifest: {exc}.") from None
    try:  # every field, as the tracker and a volunteer check it
        check_text("name", manifest.name)
        check_manifest(manifest, "manifest")
    except ConfigError as exc:
        raise DatasetError(f"{path} is not a valid data set manifest: {exc}.") from None
    return manifest


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """What ``crowdtrain dataset info`` prints."""

    name: str
    infohash: str
    files: int
    total_bytes: int
    piece_bytes: int
    pieces: int
    trackers: list[str]
    web_seeds: list[str]
    torrent_path: str
    manifest: DatasetManifest | None  # None when only a .torrent was given

    def to_dict(self) -> dict:
        from crowdtrain.protocol.messages import to_builtins

        return {
            "name": self.name,
            "infohash": self.infohash,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "piece_bytes": self.piece_bytes,
            "pieces": self.pieces,
            "trackers": self.trackers,
            "web_seeds": self.web_seeds,
            "torrent": self.torrent_path,
            "manifest": to_builtins(self.manifest) if self.manifest is not None else None,
        }


def _urls(data: bytes) -> tuple[list[str], list[str]]:
    """Announce URLs and web seeds (they sit outside the info dict)."""
    top = lt.bdecode(data)
    if not isinstance(top, dict):
        return [], []
    fields = {k: v for k, v in top.items() if isinstance(k, bytes)}  # bencoded keys decode as bytes

    def texts(value: object) -> list[str]:
        if isinstance(value, bytes):
            return [value.decode("utf-8", "replace")]
        if isinstance(value, list):
            return [t for v in value for t in texts(v)]
        return []

    trackers = texts(fields.get(b"announce"))
    trackers += [t for t in texts(fields.get(b"announce-list")) if t not in trackers]
    return trackers, texts(fields.get(b"url-list"))


def find_torrent(data_dir: Path) -> Path:
    found = sorted(data_dir.glob("*.torrent"))
    if len(found) != 1:
        raise DatasetError(
            f"{data_dir} holds {len(found)} .torrent files, not one; is it a folder made by `dataset make`?"
        )
    return found[0]


def read_dataset_info(path: str | os.PathLike) -> DatasetInfo:
    """Describe a data set folder (manifest + torrent) or a lone ``.torrent`` file."""
    p = Path(path)
    manifest = None
    if p.is_dir():
        if not (p / MANIFEST_NAME).is_file():
            raise DatasetError(f"{p} has no {MANIFEST_NAME}; is it a folder made by `dataset make`?")
        manifest = read_manifest(p / MANIFEST_NAME)
        p = find_torrent(p)
    elif not p.is_file():
        raise DatasetError(f"{p} does not exist; give a data set folder or a .torrent file.")
    try:
        if p.stat().st_size > MAX_TORRENT_BYTES:
            raise DatasetError(
                f"{p} is larger than {MAX_TORRENT_BYTES >> 20} MiB; it is not a data set torrent."
            )
        data = p.read_bytes()
    except OSError as exc:
        raise DatasetError(f"Cannot read {p}: {exc.strerror or exc}.") from None
    try:
        ti = parse_torrent(data)
    except DatasetError as exc:
        raise DatasetError(f"{p}: {exc}") from None
    if manifest is not None:
        check_torrent_matches(data, manifest)
    trackers, web_seeds = _urls(data)
    return DatasetInfo(
        name=ti.name(),
        infohash=infohash_of(data),
        files=ti.num_files(),
        total_bytes=ti.total_size(),
        piece_bytes=ti.piece_length(),
        pieces=ti.num_pieces(),
        trackers=trackers,
        web_seeds=web_seeds,
        torrent_path=str(p),
        manifest=manifest,
    )
