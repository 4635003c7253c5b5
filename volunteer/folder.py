"""One volunteer per data folder: a lock on ``DATA_DIR/.crowdtrain.lock`` held from before the join to the
exit, so a second volunteer started on the same folder (two ``join`` of one run without ``--data-dir``) is
told so in a sentence instead of breaking the first one's snapshots and chunks. A folder the volunteer made
for itself and left with nothing in it (a join that failed) is removed again.

The lock is ``flock``: the kernel drops it when the process dies, however it dies, so a SIGKILLed volunteer
never leaves a folder locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from crowdtrain.protocol.errors import CrowdtrainError

LOCK_NAME = ".crowdtrain.lock"


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
            if made and {p.name for p in path.iterdir()} <= {LOCK_NAME}:
                lock.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.rmdir()
    finally:
        os.close(fd)
