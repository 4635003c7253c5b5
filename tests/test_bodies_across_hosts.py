"""Answers are read whole across a real link (issue 28, point 1).

A tracker on one host whose uplink is shaped like a home line (``tbf``), a publisher on another: ``run create``
40 times, each answer (the run's whole spec, torrent included) decoded whole. Reading a body with one
``StreamReader.read(n)`` returns what has arrived so far, which on loopback is everything and across a link is
a cut body: this failed 2 of 40 unshaped and most of 40 shaped before bodies were read to their end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import Network, requires_netns
from tests.test_across_hosts import RUN_TOML  # the README's run file

pytestmark = [requires_netns, pytest.mark.slow, pytest.mark.timeout(300)]

PORT = 8470  # each host is its own machine: nothing else listens there
CREATES = 40

# The publisher's side, run on its host: the same calls `crowdtrain run create` and `crowdtrain status` make.
PUBLISHER = r"""
import asyncio, json, sys
from pathlib import Path
from crowdtrain.commands.run import load_spec
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.messages import encode

async def main(url, token, n):
    spec = load_spec(Path("run.toml"))
    whole, failures, sizes = 0, [], set()
    async with TrackerClient(url, timeout_s=60, admin_token=token) as client:
        for _ in range(n):
            try:
                created = await client.create_run(spec)
                status = await client.status(created.run_id)
                assert status.run_id == created.run_id
                sizes.add(len(encode(created)))
                whole += 1
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps({"whole": whole, "failures": failures, "answer_bytes": sorted(sizes)}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def test_run_create_across_a_home_link_gets_every_answer_whole(tmp_path):
    with Network(["tracker", "publisher"]) as net:
        tracker_host, pub_host = net.hosts["tracker"], net.hosts["publisher"]
        tracker_host.shape("4mbit")  # the tracker's answers leave through a home-like uplink
        (tmp_path / "tracker").mkdir()
        tracker = tracker_host.popen(
            [
                sys.executable,
                "-m",
                "crowdtrain",
                "tracker",
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                str(PORT),
            ],
            env=env_for(tmp_path / "tracker"),
            cwd=tmp_path / "tracker",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        token = None
        for line in tracker.stdout:
            if m := re.search(r"admin token: (\S+)", line):
                token = m.group(1)
                break
        assert token, "the tracker printed no admin token"
        url = f"http://{tracker_host.ip}:{PORT}"
        home = tmp_path / "publisher"
        home.mkdir()
        (home / "run.toml").write_text(RUN_TOML)
        # small chunks: a manifest of 2,000 chunks, so each answer spans many segments
        made = pub_host.run(
            [sys.executable, "-m", "crowdtrain", "dataset", "make", "builtin:stdlib", "--out", "data",
             "--tracker", url, "--chunk-size", "16KiB", "--max-bytes", "32MiB"],
            env=env_for(home), cwd=home, timeout=180,
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr
        done = pub_host.run(
            [sys.executable, "-c", PUBLISHER, url, token, str(CREATES)],
            env=env_for(home),
            cwd=home,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["failures"] == [] and result["whole"] == CREATES, result
        assert result["answer_bytes"][0] > 30_000, result  # big enough to cross the link in pieces
        # and the command itself, as the publisher types it
        cli = pub_host.run(
            [sys.executable, "-m", "crowdtrain", "run", "create", "run.toml", "--tracker", url,
             "--admin-token", token, "--json"],
            env=env_for(home), cwd=home, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["run_id"]
