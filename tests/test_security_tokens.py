"""Tokens never leak: a real ``crowdtrain tracker serve`` (DEBUG logs) and the CLI commands that carry the
admin token and a private run's join token (``run create``, ``status --json``, ``join --json``, their
failures), with every byte they print captured and searched.

What is right, decided here and in docs/security.md: ``tracker serve`` prints its admin token once, on
its own line of stdout, for the operator who started it (that is how they learn a generated one). Nothing
else — no log line, no request log, no ``--json`` output, no error or traceback — ever contains the admin
token or a join token.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crowdtrain.datasets.make import make_dataset

ADMIN = "admin-SECRET-7d1b0c5e9a2f4e33"
JOIN = "join-SECRET-41f9a0b2c8d6e177"

SPEC = """
name = "private run"
target_batch_size = 64
micro_batch_size = 4
join_policy = "token"
join_token = "{join}"

[model]
recipe = "tiny-gpt"
[model.args]
n_layer = 1
d_model = 32
n_head = 2
seq_len = 32

[dataset]
dir = "data"

[optimizer]
name = "adamw"
lr = 0.001
"""


def crowdtrain(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_admin_and_join_tokens_appear_nowhere_but_the_operators_start_line(tmp_path: Path, cli_env):
    env = dict(cli_env, CROWDTRAIN_ADMIN_TOKEN=ADMIN)
    tracker = subprocess.Popen(
        [sys.executable, "-m", "crowdtrain", "--log-level", "DEBUG", "tracker", "serve", "--db", ":memory:"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    outputs: dict[str, str] = {}
    try:
        assert tracker.stdout is not None
        first = [tracker.stdout.readline() for _ in range(4)]
        url = first[0].split()[-1]
        assert url.startswith("http://127.0.0.1:"), first
        assert first[2].strip() == f"runs on the web: {url}/", first
        assert first[3].strip() == f"admin token: {ADMIN}", first

        # a real data set: `run create` puts one of its micro-batches through the recipe
        make_dataset(
            "builtin:stdlib", tmp_path / "data", chunk_bytes=64 * 1024, max_bytes=64 * 1024,
            announce_url=url + "/announce",
        )  # fmt: skip
        spec = tmp_path / "run.toml"
        spec.write_text(SPEC.format(join=JOIN))
        plain_env = {k: v for k, v in cli_env.items() if k != "CROWDTRAIN_ADMIN_TOKEN"}

        created = crowdtrain(env, "run", "create", str(spec), "--tracker", url, "--json")
        outputs["run create --json (token from the environment)"] = created.stdout + created.stderr
        assert created.returncode == 0, created.stderr
        run_id = json.loads(created.stdout)["run_id"]
        assert json.loads(created.stdout)["spec"]["join_policy"] == "token"

        for name, args in {
            "run create, token as an option": ("--admin-token", ADMIN),
            "run create, wrong admin token": ("--admin-token", ADMIN[::-1]),
        }.items():
            out = crowdtrain(plain_env, "run", "create", str(spec), "--tracker", url, *args)
            outputs[name] = out.stdout + out.stderr
        assert "admin token is wrong" in outputs["run create, wrong admin token"]
        assert "Traceback" not in outputs["run create, wrong admin token"]
        out = crowdtrain(env, "run", "create", str(spec), "--tracker", "http://127.0.0.1:1", "--json")
        outputs["run create against a dead tracker"] = out.stdout + out.stderr
        assert out.returncode == 1
        out = crowdtrain(env, "run", "create", "--help")
        outputs["run create --help with the token in the environment"] = out.stdout + out.stderr
        out = crowdtrain(env, "status", run_id, "--tracker", url, "--json")
        outputs["status --json"] = out.stdout + out.stderr
        assert out.returncode == 0, out.stderr

        wrong = crowdtrain(
            plain_env, "join", run_id, "--tracker", url, "--token", JOIN[::-1], "--json",
            "--data-dir", str(tmp_path / "v0"),
        )  # fmt: skip
        outputs["join with a wrong join token"] = wrong.stdout + wrong.stderr
        assert wrong.returncode == 1 and "join token" in wrong.stderr, wrong.stderr

        # a real join with the right token (from the environment), until it has joined; then Ctrl-C
        joiner = subprocess.Popen(
            [sys.executable, "-m", "crowdtrain", "--log-level", "DEBUG", "join", run_id, "--tracker", url,
             "--json", "--data-dir", str(tmp_path / "v1")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(plain_env, CROWDTRAIN_JOIN_TOKEN=JOIN),
        )  # fmt: skip
        assert joiner.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = joiner.stdout.readline()
            if not line:
                break
            lines.append(line)
            if json.loads(line).get("event") in ("joined", "Joined") or '"peer_id"' in line:
                break
        joiner.send_signal(signal.SIGINT)
        rest, err = joiner.communicate(timeout=60)
        outputs["join --json with the right token"] = "".join(lines) + rest + err
        assert any('"peer_id"' in line for line in lines), "".join(lines) + err
    finally:
        tracker.send_signal(signal.SIGINT)
        out, err = tracker.communicate(timeout=60)
        outputs["tracker serve, DEBUG logs (after the start lines)"] = out + err

    assert (
        "created" in outputs["tracker serve, DEBUG logs (after the start lines)"]
    )  # the log did see the run
    leaks = [
        f"{name}: contains the {which} token"
        for name, text in outputs.items()
        for which, token in (("admin", ADMIN), ("join", JOIN))
        if token in text
    ]
    assert not leaks, "\n".join(leaks)


def test_configs_keep_tokens_out_of_their_repr():
    """A config in a log line or a traceback's locals must not carry the token with it."""
    from crowdtrain.tracker.config import TrackerConfig
    from crowdtrain.volunteer.config import VolunteerConfig

    tracker = TrackerConfig(admin_token=ADMIN)
    volunteer = VolunteerConfig(run_id="r", tracker_url="http://127.0.0.1:1", data_dir=Path("."), token=JOIN)
    assert tracker.admin_token == ADMIN and volunteer.token == JOIN
    assert ADMIN not in repr(tracker) and ADMIN not in str(tracker)
    assert JOIN not in repr(volunteer) and JOIN not in str(volunteer)
