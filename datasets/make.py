"""``crowdtrain dataset make``: cut a source into chunk files, write ``manifest.json`` and a v1 torrent.

Sources:

* a folder of UTF-8 text files (read in sorted path order, each followed by a newline) → byte-level tokens;
* a ``.jsonl`` file whose objects carry a text field (``text_field``, default ``"text"``) → byte-level tokens;
* a ``.npy`` file: a 1-D integer array is a token stream; anything else is an ``arrays`` set of its rows;
* a ``.npz`` file with ``x`` (and optionally ``y``, one label per sample) → a supervised ``arrays`` set;
* ``builtin:stdlib``: the Python standard library's own ``.py`` files (found through ``sysconfig``),
  sorted by path, as byte-level tokens: real text that every Python install has.

A text source (the folder, ``.jsonl`` and ``builtin:stdlib``) can instead be cut into the ids of a tokenizer
(the Hugging Face ``tokenizers`` library, imported only then: ``pip install 'crowdtrain[text]'``): a given
``tokenizer.json`` (``tokenizer=``), or a byte-level BPE of ``train_bpe`` tokens trained here on the same text
(its first ``max_bytes`` when given). Each document (a file, a JSON line) is encoded on its own, exactly as the
tokenizer encodes it (its post-processor's special tokens included; its truncation and padding off), and
followed by the tokenizer's end-of-text token (:data:`EOS_NAMES`; the trained BPE has ``<|endoftext|>``, id 0)
unless it already ends with it; a tokenizer without one simply concatenates its documents. Ids are stored as
uint16 when the vocabulary has at most 65536 ids, else uint32. The tokenizer is written beside the chunks as
``tokenizer.json`` and named (sha256, size, vocabulary) in the manifest, which the torrent covers.

The same input always gives the same bytes and so the same info-hash: files are read in sorted order, the
chunk format is deterministic, BPE training is deterministic (its merges break ties by the pair, whatever the
number of threads), and the torrent carries no creation date.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, Required, TypedDict

import numpy as np

from crowdtrain.datasets.chunks import (
    MANIFEST_NAME,
    chunk_name,
    encode_chunk,
    expected_dtype,
    header_bytes,
    samples_per_chunk,
)
from crowdtrain.datasets.torrent import write_torrent
from crowdtrain.protocol.errors import ConfigError, DatasetError
from crowdtrain.protocol.limits import MAX_TOKENIZER_BYTES
from crowdtrain.protocol.messages import UNSET, ChunkInfo, DatasetManifest, TokenizerInfo, encode

if TYPE_CHECKING:
    from tokenizers import Tokenizer

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_CHUNK_BYTES = 4 * MiB
MIN_CHUNK_BYTES = 4 * KiB
MAX_CHUNK_BYTES = 64 * MiB
STDLIB_SOURCE = "builtin:stdlib"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
Progress = Callable[[int, int], None]  # (bytes done, bytes total)
TOKENIZER_NAME = "tokenizer.json"
BPE_EOS = "<|endoftext|>"
BPE_MIN_VOCAB = 257  # the 256 byte tokens and BPE_EOS: no merge yet
BPE_MAX_VOCAB = 1 << 16  # ids that uint16 holds
# a tokenizer's end-of-text token, by name, in this order of preference (GPT-2, Llama 3, Llama 2 and T5, …)
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
TEXT_BATCH_BYTES = 1 * MiB  # text tokenized in one call (the library spreads a batch over its threads)


class _Layout(TypedDict, total=False):
    """The manifest's fields that a source decides (arrays: all three; tokens: the dtype)."""

    dtype: Required[str]
    sample_shape: list[int]
    label_dtype: str | None


@dataclass(frozen=True, slots=True)
class _Source:
    """A source opened for reading: its layout and a generator of row blocks."""

    kind: Literal["tokens", "arrays"]
    dtype: np.dtype  # row dtype (structured for arrays)
    manifest_fields: _Layout
    total_bytes: int  # input bytes, for progress
    blocks: Callable[[], Iterator[tuple[np.ndarray, int]]]  # yields (rows, input bytes consumed)
    default_name: str
    # a text source's documents, as UTF-8 bytes: yields (document, input bytes consumed); None for arrays
    docs: Callable[[], Iterator[tuple[bytes, int]]] | None = None


@dataclass(frozen=True, slots=True)
class _Tokenizer:
    """A tokenizer loaded or trained for a data set: the library's object and the file that ships."""

    tok: Tokenizer
    data: bytes  # tokenizer.json, as written beside the chunks
    vocab_size: int  # the largest id + 1

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(
            sha256=hashlib.sha256(self.data).hexdigest(), bytes=len(self.data), vocab_size=self.vocab_size
        )


def make_dataset(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    name: str | None = None,
    announce_url: str | None = None,
    web_seed: str | None = None,
    progress: Progress | None = None,
    text_field: str = "text",
    max_bytes: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    train_bpe: int | None = None,
) -> DatasetManifest:
    """Write chunk files, ``manifest.json`` and ``<name>.torrent`` into ``out_dir``; return the manifest.

    ``tokenizer`` (a ``tokenizer.json``) or ``train_bpe`` (a vocabulary size) cut a text source into that
    tokenizer's ids, written with ``tokenizer.json`` beside the chunks (see the module's docstring)."""
    _check_options(chunk_bytes, max_bytes, tokenizer, train_bpe)
    src = _open_source(str(source), text_field)
    tok = None
    if tokenizer is not None or train_bpe is not None:
        src, tok = _tokenize(src, source, tokenizer, train_bpe, max_bytes)
    name = _data_set_name(name, src)
    per_chunk = samples_per_chunk(src.dtype, chunk_bytes)
    if per_chunk < 1:
        raise DatasetError(
            f"A chunk of {chunk_bytes} bytes cannot hold one sample of {src.dtype.itemsize} bytes "
            f"(plus a {header_bytes(src.dtype, 1)}-byte header); use a larger --chunk-size."
        )
    out = _prepare_out_dir(Path(out_dir), Path(str(source)))
    cut = _cut(src, _Chunker(out, per_chunk), max_bytes, progress)
    if not cut.chunks:
        raise DatasetError(f"Source {source} holds no data (no text, samples or tokens); nothing to make.")
    if progress is not None:
        total = src.total_bytes if max_bytes is None else min(src.total_bytes, max_bytes)
        progress(total, total)
    manifest = _manifest(name, src, chunk_bytes, cut, tok)
    if tok is not None:
        (out / TOKENIZER_NAME).write_bytes(tok.data)
    (out / MANIFEST_NAME).write_bytes(encode(manifest))
    write_torrent(out, manifest, announce_url=announce_url, web_seed=web_seed)
    return manifest


def _manifest(
    name: str, src: _Source, chunk_bytes: int, cut: _Chunker, tok: _Tokenizer | None
) -> DatasetManifest:
    """What ``cut`` wrote from ``src``, as the manifest describes it to volunteers."""
    manifest = DatasetManifest(
        name=name,
        kind=src.kind,
        chunk_bytes=chunk_bytes,
        chunks=cut.chunks,
        total_samples=cut.rows_written,
        **src.manifest_fields,
        tokenizer=UNSET if tok is None else tok.info(),
    )
    if expected_dtype(manifest) != src.dtype:  # a programming error, not an input error
        raise RuntimeError(f"chunk dtype {src.dtype} differs from the manifest's {expected_dtype(manifest)}")
    return manifest


def _check_options(
    chunk_bytes: int, max_bytes: int | None, tokenizer: str | os.PathLike | None, train_bpe: int | None
) -> None:
    """Refuse settings no source can be made with, before anything is read."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ConfigError(
            "chunk_bytes",
            f"{chunk_bytes} bytes is outside {MIN_CHUNK_BYTES} B..{MAX_CHUNK_BYTES // MiB} MiB; "
            "choose a chunk size such as 4MiB",
        )
    if max_bytes is not None and max_bytes <= 0:
        raise ConfigError("max_bytes", "must be a positive number of bytes")
    if tokenizer is not None and train_bpe is not None:
        raise ConfigError("train_bpe", "give a tokenizer file or a BPE vocabulary to train, not both")
    if train_bpe is not None and not BPE_MIN_VOCAB <= train_bpe <= BPE_MAX_VOCAB:
        raise ConfigError(
            "train_bpe", f"{train_bpe} tokens is outside {BPE_MIN_VOCAB}..{BPE_MAX_VOCAB} (256 bytes, "
            "<|endoftext|> and the merges); choose e.g. 4096",
        )  # fmt: skip


def _data_set_name(name: str | None, src: _Source) -> str:
    """``name``, or one made from the source's (its letters, digits, '.', '_' and '-'), checked."""
    name = name or (re.sub(r"[^A-Za-z0-9._-]", "-", src.default_name).lstrip("._-")[:64] or "dataset")
    if not NAME_RE.fullmatch(name):
        raise ConfigError(
            "name", f"{name!r} is not a data set name; use 1-64 letters, digits, '.', '_' or '-'"
        )
    return name


# ------------------------------------------------------------------ chunks


class _Chunker:
    """Rows in, chunk files out: rows wait until a chunk's worth has come, then go to the next chunk file."""

    def __init__(self, out: Path, per_chunk: int) -> None:
        self.out = out
        self.per_chunk = per_chunk
        self.chunks: list[ChunkInfo] = []
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.rows_written = 0

    @property
    def rows_taken(self) -> int:
        """Rows written to chunk files or waiting for the next one."""
        return self.rows_written + self.pending_rows

    def add(self, rows: np.ndarray) -> None:
        """Take ``rows``; write each chunk they complete."""
        if len(rows):
            self.pending.append(rows)
            self.pending_rows += len(rows)
        while self.pending_rows >= self.per_chunk:
            self._write(self.per_chunk)

    def finish(self) -> None:
        """Write the rows still waiting as the last, shorter chunk."""
        if self.pending_rows:
            self._write(self.pending_rows)

    def _write(self, rows: int) -> None:
        data = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        head, rest = data[:rows], data[rows:]
        blob = encode_chunk(head)
        fname = chunk_name(len(self.chunks))
        (self.out / fname).write_bytes(blob)
        self.chunks.append(
            ChunkInfo(name=fname, samples=rows, bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        )
        self.pending = [rest] if len(rest) else []
        self.pending_rows = len(rest)
        self.rows_written += rows


def _cut(src: _Source, chunker: _Chunker, max_bytes: int | None, progress: Progress | None) -> _Chunker:
    """Every row block of ``src`` (its first ``max_bytes`` when given) through ``chunker``, the input bytes
    read told to ``progress`` after each block; the last chunk written too."""
    limit_rows = None if max_bytes is None else max(1, max_bytes // src.dtype.itemsize)
    total = src.total_bytes if max_bytes is None else min(src.total_bytes, max_bytes)
    done = 0
    for rows, consumed in src.blocks():
        if limit_rows is not None and chunker.rows_taken + len(rows) > limit_rows:
            rows = rows[: limit_rows - chunker.rows_taken]
        chunker.add(rows)
        done = min(total, done + consumed)
        if progress is not None:
            progress(done, total)
        if limit_rows is not None and chunker.rows_taken >= limit_rows:
            break
    chunker.finish()
    return chunker


# ------------------------------------------------------------------ output folder


def _prepare_out_dir(out: Path, source: Path) -> Path:
    """Create ``out`` or clear a previous ``make`` output in it; refuse a folder holding anything else."""
    if out.exists() and not out.is_dir():
        raise DatasetError(f"Output {out} exists and is not a folder; choose another --out.")
    out.mkdir(parents=True, exist_ok=True)
    ours = re.compile(
        r"^(chunk-\d{5}\.npy|manifest\.json|tokenizer\.json|.*\.torrent|\.resume(-[0-9a-f]{40})?)$"
    )
    foreign = [p.name for p in out.iterdir() if not ours.match(p.name)]
    if foreign:
        raise DatasetError(
            f"Output folder {out} already holds files that are not a data set ({', '.join(sorted(foreign)[:3])}); "
            "choose an empty or new folder."
        )
    try:
        if source.exists() and source.resolve() == out.resolve():
            raise DatasetError(f"Output folder {out} is the source itself; choose another --out.")
    except OSError:
        pass
    for p in out.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return out


# ------------------------------------------------------------------ sources


def _open_source(source: str, text_field: str) -> _Source:
    if source == STDLIB_SOURCE:
        return _stdlib_source()
    if source.startswith("builtin:"):
        raise DatasetError(f"Unknown built-in source {source!r}; the built-in corpus is {STDLIB_SOURCE!r}.")
    path = Path(source)
    if not path.exists():
        raise DatasetError(
            f"Source {source} does not exist; give a folder of text files, a .jsonl, .npy or .npz file, "
            f"or {STDLIB_SOURCE}."
        )
    if path.is_dir():
        files = sorted(
            (
                p
                for p in path.rglob("*")
                if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        return _text_files_source(files, path.name or "dataset", check_utf8=True)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _jsonl_source(path, text_field)
    if suffix == ".npy":
        return _npy_source(path)
    if suffix == ".npz":
        return _npz_source(path)
    raise DatasetError(
        f"Source {source} is a {suffix or 'suffix-less'} file; crowdtrain reads a folder of text files, "
        ".jsonl, .npy or .npz."
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(
            f"Cannot read {path}: {exc.strerror or exc}; check its permissions or leave it out of the source."
        ) from None


def _byte_source(total: int, default_name: str, docs: Callable[[], Iterator[tuple[bytes, int]]]) -> _Source:
    def blocks() -> Iterator[tuple[np.ndarray, int]]:
        for doc, consumed in docs():
            if doc:
                yield np.frombuffer(doc + b"\n", dtype=np.uint8), consumed
            else:
                yield np.empty(0, np.uint8), consumed

    return _Source(
        kind="tokens",
        dtype=np.dtype(np.uint8),
        manifest_fields={"dtype": "uint8"},
        total_bytes=total,
        blocks=blocks,
        default_name=default_name,
        docs=docs,
    )


def _text_files_source(files: list[Path], default_name: str, *, check_utf8: bool) -> _Source:
    sizes = []
    for p in files:
        try:
            sizes.append(p.stat().st_size)
        except OSError as exc:
            raise DatasetError(f"Cannot read {p}: {exc.strerror or exc}; check it or leave it out.") from None
    if not files or sum(sizes) == 0:
        raise DatasetError(f"Source {default_name} holds no text files with content; nothing to make.")

    def docs() -> Iterator[tuple[bytes, int]]:
        for p in files:
            data = _read(p)
            if check_utf8:
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetError(
                        f"{p} is not UTF-8 text (byte {exc.start}); convert it or leave it out of the source."
                    ) from None
            yield data, len(data)

    return _byte_source(sum(sizes), default_name, docs)


def _stdlib_source() -> _Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and not skip & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise DatasetError(f"No .py files found in the standard library folder {root}; use another source.")
    src = _text_files_source(files, "python-stdlib", check_utf8=False)
    return src


def _jsonl_source(path: Path, text_field: str) -> _Source:
    try:
        total = path.stat().st_size
    except OSError as exc:
        raise DatasetError(f"Cannot read {path}: {exc.strerror or exc}.") from None

    def docs() -> Iterator[tuple[bytes, int]]:
        try:
            f = path.open("rb")
        except OSError as exc:
            raise DatasetError(f"Cannot read {path}: {exc.strerror or exc}; check its permissions.") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    yield b"", len(line)
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise DatasetError(
                        f"{path} line {lineno} is not JSON ({exc}); fix or remove that line."
                    ) from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise DatasetError(
                        f"{path} line {lineno} has no {text_field!r} field; pass --text-field with the field "
                        "that holds the text."
                    )
                text = obj[text_field]
                if not isinstance(text, str):
                    raise DatasetError(f"{path} line {lineno}: field {text_field!r} is not a string.")
                yield text.encode("utf-8"), len(line)

    return _byte_source(total, path.stem, docs)


def _load_npy(path: Path, mmap: bool) -> np.ndarray | np.lib.npyio.NpzFile:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except OSError as exc:
        raise DatasetError(f"Cannot read {path}: {exc.strerror or exc}; check its permissions.") from None
    except ValueError as exc:
        raise DatasetError(f"{path} is not a NumPy array file crowdtrain can read safely: {exc}.") from None


def _little(dtype: np.dtype) -> np.dtype:
    if dtype.kind not in "biuf":
        raise DatasetError(f"Array dtype {dtype} is not supported; use booleans, integers or floats.")
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _rows_blocks(columns: dict[str, np.ndarray], dtype: np.dtype, n: int) -> Callable[[], Iterator]:
    step = max(1, (16 * MiB) // max(1, dtype.itemsize))

    def blocks() -> Iterator[tuple[np.ndarray, int]]:
        for start in range(0, n, step):
            stop = min(n, start + step)
            if dtype.names is None:
                rows = np.asarray(columns["x"][start:stop], dtype=dtype)
            else:
                rows = np.empty(stop - start, dtype=dtype)
                for key, col in columns.items():
                    rows[key] = col[start:stop]
            yield rows, (stop - start) * dtype.itemsize

    return blocks


def _npy_source(path: Path) -> _Source:
    arr = _load_npy(path, mmap=True)
    if not isinstance(arr, np.ndarray):  # np.load goes by the file's bytes, not its name
        raise DatasetError(f"Source {path} is an .npz archive of arrays, not one array; name it .npz.")
    if arr.ndim == 0 or len(arr) == 0:
        raise DatasetError(f"Source {path} holds no samples (shape {arr.shape}); nothing to make.")
    dt = _little(arr.dtype)
    if arr.ndim == 1 and dt.kind in "iu":
        return _Source(
            kind="tokens",
            dtype=dt,
            manifest_fields={"dtype": dt.name},
            total_bytes=arr.nbytes,
            blocks=_rows_blocks({"x": arr}, dt, len(arr)),
            default_name=path.stem,
        )
    return _arrays_source(path, arr, None)


def _npz_source(path: Path) -> _Source:
    npz = _load_npy(path, mmap=False)
    if isinstance(npz, np.ndarray):
        raise DatasetError(f"Source {path} holds one array, not an .npz archive of x and y; name it .npy.")
    with npz:
        keys = list(npz.keys())
        if "x" in keys:
            x = _npz_array(npz, "x", path)
            y = _npz_array(npz, "y", path) if "y" in keys else None
        elif len(keys) == 1:
            x, y = _npz_array(npz, keys[0], path), None
        else:
            raise DatasetError(
                f"{path} holds arrays {keys[:5]} but no 'x'; save the samples as x (and labels as y)."
            )
    if x.ndim == 0 or len(x) == 0:
        raise DatasetError(f"Source {path} holds no samples (x has shape {x.shape}); nothing to make.")
    return _arrays_source(path, x, y)


def _npz_array(npz: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    try:
        return npz[key]
    except (ValueError, OSError) as exc:
        raise DatasetError(f"Cannot read array {key!r} from {path}: {exc}.") from None


def _arrays_source(path: Path, x: np.ndarray, y: np.ndarray | None) -> _Source:
    xdt = _little(x.dtype)
    fields: list[tuple] = [("x", xdt, tuple(x.shape[1:]))]
    columns = {"x": x}
    label_dtype = None
    if y is not None:
        if y.ndim != 1 or len(y) != len(x):
            raise DatasetError(
                f"{path}: y has shape {y.shape} but must hold one label per sample ({len(x)},)."
            )
        ydt = _little(y.dtype)
        fields.append(("y", ydt))
        columns["y"] = y
        label_dtype = ydt.name
    dtype = np.dtype(fields)
    return _Source(
        kind="arrays",
        dtype=dtype,
        manifest_fields={"dtype": xdt.name, "sample_shape": list(x.shape[1:]), "label_dtype": label_dtype},
        total_bytes=len(x) * dtype.itemsize,
        blocks=_rows_blocks(columns, dtype, len(x)),
        default_name=path.stem,
    )


# ------------------------------------------------------------------ tokenizers


def _tokenize(
    src: _Source,
    source: str | os.PathLike,
    tokenizer: str | os.PathLike | None,
    train_bpe: int | None,
    max_bytes: int | None,
) -> tuple[_Source, _Tokenizer]:
    """``src``'s text cut into the ids of ``tokenizer`` (a file) or of a BPE of ``train_bpe`` tokens trained on
    that text, and the tokenizer; a source of arrays or ids is refused."""
    option = "--tokenizer" if tokenizer is not None else "--train-bpe"
    docs = src.docs
    if docs is None:
        raise DatasetError(
            f"{option} tokenizes text, but {source} holds arrays or token ids already; give a folder of "
            f"text files, a .jsonl file or {STDLIB_SOURCE}."
        )
    lib = _tokenizers_library(option)
    if tokenizer is not None:
        tok = _load_tokenizer(lib, Path(tokenizer))
    else:
        tok = _train_bpe(lib, docs, train_bpe or 0, max_bytes)
    return _tokenized(src, docs, tok), tok


def _tokenizers_library(option: str) -> ModuleType:
    """The ``tokenizers`` module, imported only for a data set cut with a tokenizer (an optional extra)."""
    try:
        import tokenizers
    except ImportError:
        raise DatasetError(f"{option} needs the tokenizers library: pip install 'crowdtrain[text]'") from None
    return tokenizers


def _vocab_size(tok: Tokenizer) -> int:
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def _load_tokenizer(lib: ModuleType, path: Path) -> _Tokenizer:
    """A ``tokenizer.json`` file, loaded to encode with; its bytes ship unchanged."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DatasetError(
            f"Cannot read the tokenizer {path}: {exc.strerror or exc}; give your tokenizer's tokenizer.json."
        ) from None
    if size > MAX_TOKENIZER_BYTES:
        raise DatasetError(
            f"The tokenizer {path} is {size} bytes, more than the {MAX_TOKENIZER_BYTES >> 20} MiB a data set's "
            "tokenizer may have."
        )
    data = _read(path)
    try:
        tok = lib.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the library raises a plain Exception; UnicodeDecodeError is one too
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DatasetError(
            f"{path} is not a tokenizer the tokenizers library can load ({reason}); give a tokenizer.json "
            "written by Tokenizer.save."
        ) from None
    vocab_size = _vocab_size(tok)
    if vocab_size < 1:
        raise DatasetError(f"The tokenizer {path} has no tokens; give a trained tokenizer.")
    if vocab_size > 1 << 32:
        raise DatasetError(f"The tokenizer {path} has ids up to {vocab_size - 1}, more than uint32 holds.")
    return _Tokenizer(tok, data, vocab_size)


Docs = Callable[[], Iterator[tuple[bytes, int]]]


def _texts(docs: Docs, max_bytes: int | None) -> Iterator[str]:
    """The source's documents as text (the first ``max_bytes`` of them when given): what BPE trains on."""
    seen = 0
    for doc, _ in docs():
        if max_bytes is not None and seen >= max_bytes:
            return
        if doc:
            seen += len(doc)
            yield doc.decode("utf-8", errors="replace")


def _train_bpe(lib: ModuleType, docs: Docs, vocab: int, max_bytes: int | None) -> _Tokenizer:
    """A byte-level BPE (GPT-2's layout) of at most ``vocab`` tokens, trained on the source's text: id 0 is
    ``<|endoftext|>``, ids 1-256 the bytes, the rest merges. Deterministic: the same text gives the same file."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = lib.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(docs, max_bytes), trainer=trainer)
    return _Tokenizer(tok, tok.to_str().encode("utf-8"), _vocab_size(tok))


def _eos_id(tok: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (a special token named in EOS_NAMES), if it has one."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in EOS_NAMES if name in special), None)


def _tokenized(src: _Source, docs: Docs, tokenizer: _Tokenizer) -> _Source:
    """``src``'s documents as the tokenizer's ids, each document followed by its end-of-text token."""
    tok = tokenizer.tok
    tok.no_truncation()  # a tokenizer.json may carry a model's input length and padding: a document is whole
    tok.no_padding()
    eos = _eos_id(tok)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)

    def encode(texts: list[str]) -> np.ndarray:
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids += enc.ids
            if eos is not None and (not enc.ids or enc.ids[-1] != eos):
                ids.append(eos)
        arr = np.array(ids, dtype=np.int64)
        if arr.size and not 0 <= arr.min() <= arr.max() < tokenizer.vocab_size:  # (the library's promise)
            raise DatasetError(f"The tokenizer gave ids outside 0..{tokenizer.vocab_size - 1}; check it.")
        return arr.astype(dtype)

    def blocks() -> Iterator[tuple[np.ndarray, int]]:
        texts: list[str] = []
        size = consumed = 0
        for doc, n in docs():
            consumed += n
            if doc:
                texts.append(doc.decode("utf-8", errors="replace"))
                size += len(doc)
            if size >= TEXT_BATCH_BYTES:
                yield encode(texts), consumed
                texts, size, consumed = [], 0, 0
        if texts or consumed:
            yield encode(texts) if texts else np.empty(0, dtype), consumed

    return _Source(
        kind="tokens",
        dtype=dtype,
        manifest_fields={"dtype": dtype.name},
        total_bytes=src.total_bytes,
        blocks=blocks,
        default_name=src.default_name,
        docs=docs,
    )
