"""A volunteer's data folder (volunteer/folder.py): held by one volunteer at a time, and the keeper of its
identity, so the same volunteer joining again is the same key in the tracker's credit ledger."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from crowdtrain.protocol.errors import CrowdtrainError
from crowdtrain.volunteer.folder import KEY_NAME, data_folder, folder_key


def test_the_key_is_made_once_kept_owner_only_and_read_back(tmp_path):
    with data_folder(tmp_path / "v") as folder:
        first = folder_key(folder)
        assert folder_key(folder).public_hex == first.public_hex
        mode = stat.S_IMODE(os.stat(folder / KEY_NAME).st_mode)
        assert mode == 0o600, oct(mode)
        (folder / "chunk-00000.bin").write_bytes(b"x")
    with data_folder(tmp_path / "v") as folder:  # joining again: the same identity
        assert folder_key(folder).public_hex == first.public_hex


def test_a_damaged_key_is_a_sentence_not_a_new_identity(tmp_path):
    with data_folder(tmp_path / "v") as folder:
        (folder / KEY_NAME).write_bytes(b"not a key")
        with pytest.raises(CrowdtrainError, match="is not a crowdtrain key"):
            folder_key(folder)


def test_a_folder_made_for_a_join_that_failed_goes_and_a_killed_holder_frees_it(tmp_path):
    with pytest.raises(RuntimeError), data_folder(tmp_path / "v") as folder:
        folder_key(folder)
        raise RuntimeError("the join failed")
    assert not (tmp_path / "v").exists()
    # a holder SIGKILLed: the kernel drops its lock, the next volunteer takes the folder
    script = textwrap.dedent(
        f"""
        import os, signal
        from crowdtrain.volunteer.folder import data_folder
        with data_folder(__import__("pathlib").Path({str(tmp_path / "w")!r})):
            print("held", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert killed.stdout.strip() == "held" and killed.returncode == -9, killed
    with data_folder(tmp_path / "w"):
        pass
