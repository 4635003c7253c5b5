"""The two faces a person sees: `crowdtrain join` on a real terminal, and `crowdtrain demo` end to end."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from tests.harness import published_run

PANELS = ("collaboration", "local training", "data set", "averaging", "state sync")


def _read_all(fd: int) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_join_on_a_terminal_shows_the_live_panels(tmp_path):
    async with published_run(tmp_path, target_batch_size=32) as run:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS="120", LINES="50", OMP_NUM_THREADS="1")
        env.pop("NO_COLOR", None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "crowdtrain",
            "join",
            run.spec.run_id,
            "--tracker",
            run.tracker.url,
            "--data-dir",
            str(tmp_path / "volunteer"),
            "--max-steps",
            "3",
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
        )
        os.close(slave)
        reader = asyncio.create_task(asyncio.to_thread(_read_all, master))
        code = await asyncio.wait_for(proc.wait(), 240)
        screen = (await asyncio.wait_for(reader, 30)).decode(errors="replace")
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert code == 0, text[-3000:]
    for panel in PANELS:
        assert panel in text, f"panel {panel!r} not on screen:\n{text[-3000:]}"
    assert run.spec.run_id in text
    assert "\x1b[" in screen  # it drew a live view with cursor movement, not plain lines


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_with_two_volunteers_runs_to_its_summary_and_leaves_no_process(cli_env):
    cli_env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "demo", "--volunteers", "2", "--steps", "5"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=360,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo summary" in out.stdout
    loss = re.search(r"training loss\s+([\d.]+) → ([\d.]+)", out.stdout)
    assert loss, out.stdout[-2000:]
    assert float(loss.group(2)) < float(loss.group(1))
    assert re.search(r"global steps\s+5 ", out.stdout)
    # one event, one line, whatever the width: a pipe is no reason to wrap (issue 15)
    joined = [line for line in out.stdout.splitlines() if " joined run " in line]
    assert joined and all(len(line) > 80 and "codec" in line for line in joined), joined
    assert re.search(r"compute share\s+mean \d+%", out.stdout), out.stdout[-2000:]
    run_id = re.search(r"^run\s+(\S+)", out.stdout, re.M).group(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert run_id not in ps, [line for line in ps.splitlines() if run_id in line]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_late_volunteer_joins_a_moving_run_catches_up_and_computes(cli_env):
    cli_env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(  # 3 volunteers, 30 steps: the demo a newcomer sees
        [sys.executable, "-m", "crowdtrain", "demo", "--plain"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=360,
    )
    text = out.stdout
    assert out.returncode == 0, text[-3000:] + out.stderr[-3000:]
    assert re.search(r"^volunteer-3 joins late, at global step \d+$", text, re.M), text[-3000:]
    late = re.search(
        r"^late joiner\s+volunteer-3 joined at step (\d+), caught up from peers \(the state of step (\d+) "
        r"in [\d.]+ s\), then put ([\d,]+) samples into (\d+) of the (\d+) steps since and computed (\d+)% "
        r"of its time$",
        text,
        re.M,
    )
    assert late, text[-3000:]
    joined, loaded, samples, steps_in, steps_since, share = (int(g.replace(",", "")) for g in late.groups())
    assert joined >= 1 and loaded >= joined  # the run had moved on: it loaded a state from its peers
    assert samples > 0 and steps_in > 0 and steps_since > 0
    assert share > 0
    assert re.search(r"^state catch-up\s+.*volunteer-3.* loaded the run's state from peers$", text, re.M)
    compute = re.search(r"^compute share\s+mean \d+%: .*volunteer-3 (\d+)%", text, re.M)
    assert compute and int(compute.group(1)) > 0, text[-2000:]
