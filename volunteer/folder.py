"""One volunteer per data folder: a lock on ``DATA_DIR/.crowdtrain.lock`` held from before the join to the
exit, so a second volunteer started on the same folder (two ``join`` of one run without ``--data-dir``) is
told so in a sentence instead of breaking the first one's snapshots and chunks. A folder the volunteer made
for itself and left with nothing in it (a join that failed) is removed again.

The folder also keeps the volunteer's identity, its Ed25519 key (``DATA_DIR/.crowdtrain-key``, owner-only):
the same volunteer joining again is the same key, so the tracker's credit ledger adds up its work.

The lock is ``flock``: the kernel drops it when the process dies, however it dies, so a SIGKILLed volunteer
never leaves a folder locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.errors import CrowdtrainError

LOCK_NAME = ".crowdtrain.lock"
KEY_NAME = ".crowdtrain-key"


@contextlib.contextmanager
def data_folder(path: Path) -> Iterator[Path]:
    """Hold ``path`` (made if missing) for this process; :class:`CrowdtrainError` if another holds it."""
    made = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CrowdtrainError(
            f"cannot make the data folder {path} ({exc.strerror}); choose another --data-dir"
        ) from None
    lock = path / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise CrowdtrainError(
                f"the data folder {path} is in use by another volunteer (process {holder}); give this one its "
                "own folder with --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            if made and {p.name for p in path.iterdir()} <= {LOCK_NAME, KEY_NAME}:
                (path / KEY_NAME).unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.rmdir()
    finally:
        os.close(fd)


def folder_key(path: Path) -> SigningKey:
    """The volunteer's key kept in its (held) data folder: read, or made and kept (mode 0600)."""
    kept = path / KEY_NAME
    try:
        raw = kept.read_bytes()
    except FileNotFoundError:
        key = SigningKey()
        tmp = kept.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key.private_bytes())
        os.replace(tmp, kept)
        return key
    if len(raw) != 32:
        raise CrowdtrainError(f"{kept} is not a crowdtrain key (32 bytes); move it away to start afresh")
    return SigningKey.from_bytes(raw)
