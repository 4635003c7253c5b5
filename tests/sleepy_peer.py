"""A real Averager in a process of its own, so a test can stop it (SIGSTOP) in the middle of a round:
``python -m tests.sleepy_peer``, driven by JSON lines on stdin, answering JSON lines on stdout.

First line: ``{"run_id", "tracker_url", "tracker_public_key", "peer_id", "key", "credential"}`` (``key``: the
signing key's private bytes in hex; ``credential``: the JSON of its Credential). It serves its averaging routes
on 127.0.0.1 and prints ``{"port": N}``. Each next line ``{"assignment": <GroupAssignment JSON>, "fill": x,
"size": n, "weight": w}`` runs one round with a vector of ``n`` values ``x`` and prints ``{"late": bool,
"failed": [parts]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from aiohttp import web

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.credentials import SigningKey
from crowdtrain.protocol.messages import Credential, GroupAssignment, decode
from crowdtrain.volunteer.averaging import Averager, AveragingConfig
from crowdtrain.volunteer.averaging.cutting import tracker_referee


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    setup = json.loads(await reader.readline())
    key = SigningKey.from_bytes(bytes.fromhex(setup["key"]))
    credential = decode(setup["credential"], Credential)
    async with TrackerClient(setup["tracker_url"]) as tracker:
        averager = Averager(
            run_id=setup["run_id"],
            tracker_public_key=setup["tracker_public_key"],
            peer_id=setup["peer_id"],
            key=key,
            credential=credential,
            config=AveragingConfig(clip_multiple=0.0, assignment_wait_s=30.0),
            referee=tracker_referee(tracker, setup["run_id"], setup["peer_id"], key, credential),
        )
        app = web.Application()
        app.add_routes(averager.routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        say({"port": runner.addresses[0][1]})
        try:
            while line := await reader.readline():
                job = json.loads(line)
                a = decode(json.dumps(job["assignment"]), GroupAssignment)
                vector = np.full(job["size"], job["fill"], dtype=np.float32)
                result = await averager.allreduce(a, vector, float(job["weight"]))
                say({"late": result.late, "failed": list(result.failed_parts)})
        finally:
            await averager.close()
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
