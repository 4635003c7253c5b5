"""A donor process SIGKILLed in the middle of a state transfer: the newcomer completes it from the others."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch

from crowdtrain.protocol.credentials import SigningKey, issue_credential
from crowdtrain.protocol.messages import Donor, encode
from crowdtrain.volunteer.events import Event, StateLoaded, StateSyncProgress
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.fetch import fetch_state
from crowdtrain.volunteer.state.snapshot import save_snapshot

KiB = 1 << 10
RUN = "run-kill"

# A donor serves the snapshot file the way a volunteer does: file-backed, under the manifest its writer made.
DONOR = """
import asyncio, json, sys
from pathlib import Path
from aiohttp import web
from crowdtrain.protocol.messages import StateManifest, decode
from crowdtrain.volunteer.state.config import StateConfig
from crowdtrain.volunteer.state.serve import StateServer
from crowdtrain.volunteer.state.snapshot import Snapshot

async def main(path, tracker_key, manifest):
    config = StateConfig(range_bytes=64 * 1024, upload_rate=512 * 1024)
    server = StateServer(run_id="run-kill", tracker_public_key=tracker_key, config=config)
    server.publish(Snapshot.of(decode(manifest, StateManifest), path=Path(path)))
    app = web.Application()
    app.add_routes(server.routes())
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


@pytest.mark.slow
async def test_donor_sigkilled_mid_transfer_download_completes_from_the_others(tmp_path):
    tracker = SigningKey()
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "state.safetensors"
    snap = save_snapshot(
        path,
        run_id=RUN,
        step=10,
        recipe="tiny",
        args={},
        model_state={"w": torch.randn(600_000, generator=gen)},
        optimizer_state={"state": {}, "param_groups": []},
        scheduler_state=None,
        range_bytes=64 * KiB,
    )
    procs = []
    try:
        for _ in range(3):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                DONOR,
                str(path),
                tracker.public_hex,
                encode(snap.manifest).decode(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            procs.append(proc)
        donors = []
        for i, proc in enumerate(procs):
            async with asyncio.timeout(60):
                port = json.loads(await proc.stdout.readline())["port"]
            donors.append(
                Donor(peer_id=f"d{i}", address=f"127.0.0.1:{port}", public_key=SigningKey().public_hex)
            )

        victim = procs[0]
        quarter = asyncio.Event()

        def emit(event: Event) -> None:
            events.append(event)
            if isinstance(event, StateSyncProgress) and event.done_bytes >= event.total_bytes // 4:
                quarter.set()

        async def kill_at_a_quarter() -> None:
            await quarter.wait()
            victim.kill()  # SIGKILL: no clean shutdown, connections cut mid-range
            await victim.wait()

        events: list[Event] = []
        key = SigningKey()
        credential = issue_credential(tracker, RUN, "newcomer", key.public_hex, ttl_s=600)
        config = StateConfig(
            range_bytes=64 * KiB, connect_timeout_s=2.0, read_timeout_s=5.0, range_timeout_s=30.0
        )
        async with asyncio.timeout(100):
            killer = asyncio.create_task(kill_at_a_quarter())
            data = await fetch_state(
                donors=donors,
                version=snap.version,
                run_id=RUN,
                key=key,
                credential=credential,
                config=config,
                emit=emit,
            )
            await killer
        assert data == path.read_bytes()
        assert victim.returncode is not None and victim.returncode < 0  # it really was killed
        loaded = events[-1]
        assert isinstance(loaded, StateLoaded) and len(loaded.donors_used) >= 2
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.stdin.close()
                try:
                    async with asyncio.timeout(10):
                        await proc.wait()
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
