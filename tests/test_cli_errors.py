"""Every error a user can cause at the command line ends in one sentence on stderr and exit 1: no
traceback, also when the error is raised inside a task group (issue 16)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys


def crowdtrain(cli_env, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", *args],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=timeout,
    )


def assert_one_sentence(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])


async def test_join_of_a_run_the_tracker_does_not_know(cli_env, tracker, tmp_path):
    # the command runs in a thread: this test's event loop serves the tracker meanwhile
    out = await asyncio.to_thread(
        crowdtrain, cli_env, "join", "nosuchrun", "--tracker", tracker.url, "--data-dir", str(tmp_path / "v")
    )
    assert_one_sentence(out, "nosuchrun")
    assert not (tmp_path / "v").exists()  # a failed join leaves no empty data folder behind


async def test_join_on_a_data_folder_another_volunteer_holds_is_told_so_and_touches_nothing(
    cli_env, tracker, tmp_path
):
    """Two volunteers of one run on one machine without --data-dir share a folder: the second is refused
    with a sentence (the first here holds it as a volunteer does, from this process)."""
    from crowdtrain.volunteer.folder import data_folder

    folder = tmp_path / "v"
    with data_folder(folder):
        (folder / "chunk-0000").write_bytes(b"held")
        out = await asyncio.to_thread(
            crowdtrain, cli_env, "join", "anyrun", "--tracker", tracker.url, "--data-dir", str(folder)
        )
    assert_one_sentence(
        out, str(folder), "in use by another volunteer", f"process {os.getpid()}", "--data-dir"
    )
    assert (folder / "chunk-0000").read_bytes() == b"held"
    with data_folder(folder):  # free again once its holder let go
        pass


def test_tracker_serve_on_a_port_in_use(cli_env, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = crowdtrain(cli_env, "tracker", "serve", "--port", str(port), "--db", str(tmp_path / "t.db"))
    assert_one_sentence(out, f"127.0.0.1:{port}", "in use", "--port")


def test_tracker_serve_with_a_db_that_is_not_a_database(cli_env, tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("these are my notes, not a database\n" * 100)
    out = crowdtrain(cli_env, "tracker", "serve", "--port", "0", "--db", str(bogus))
    assert_one_sentence(out, "database", "--db")
    assert bogus.read_text().startswith("these are my notes"), "the file was changed"


def test_dataset_make_into_a_path_that_cannot_be_a_folder(cli_env):
    out = crowdtrain(cli_env, "dataset", "make", "builtin:stdlib", "--out", "/dev/null/x")
    assert_one_sentence(out, "/dev/null/x")
