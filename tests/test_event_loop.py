"""The commands' event loop (crowdtrain.commands.common.new_event_loop, uvloop where installed): a peer that hangs
up in the middle of an upload fails the request once, not a second time as a traceback from aiohttp's writer
task; a connection over the per-address bound gets its 503 sentence on either loop."""

from __future__ import annotations

import asyncio
import gc
import logging

import aiohttp
import pytest

from crowdtrain.commands.common import new_event_loop


async def _hangs_up_mid_upload(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A peer that reads the request's head, then ends its side (no answer) and drains what still comes."""
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(0.05)
    writer.write_eof()
    while await reader.read(1 << 20):
        pass
    writer.close()


async def _upload_to_a_peer_that_hangs_up() -> str:
    server = await asyncio.start_server(_hangs_up_mid_upload, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def body():  # streamed (chunked), as a member's copy of a part is
        yield b"x" * (32 << 20)

    try:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/allreduce/r/t/0", data=body()) as resp:
                    return f"answered {resp.status}"
            except aiohttp.ClientError as exc:
                return type(exc).__name__
            finally:
                await asyncio.sleep(0.3)  # aiohttp's writer task ends (with the failure) meanwhile
    finally:
        gc.collect()  # an unretrieved task failure is reported when the task is collected
        await asyncio.sleep(0.05)
        server.close()
        await server.wait_closed()


def _run(coro_fn) -> object:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro_fn())


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_peer_hanging_up_mid_upload_fails_the_request_and_logs_no_traceback(loop, monkeypatch, caplog):
    monkeypatch.setenv("CROWDTRAIN_LOOP", loop)
    caplog.set_level(logging.INFO)
    for _ in range(3):  # (the writer task's failure depends on which of the two wakes first)
        assert _run(_upload_to_a_peer_that_hangs_up) == "ServerDisconnectedError"
    unhandled = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not unhandled, [r.getMessage() for r in unhandled]


def test_other_unretrieved_failures_are_still_reported(caplog):
    async def fails() -> None:
        raise ConnectionResetError("not aiohttp's writer")

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(fails())
        await asyncio.sleep(0.01)
        assert task.done()
        del task
        gc.collect()
        await asyncio.sleep(0.01)

    caplog.set_level(logging.INFO)
    _run(main)
    reported = [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert len(reported) == 1 and "not aiohttp's writer" in reported[0], reported


async def _over_the_bound() -> tuple[str, bytes]:
    """The answer to one connection more than the bound from one address (127.0.0.2: counted), on the running
    loop (its module's name too)."""
    from aiohttp import web

    from crowdtrain.protocol.serving import (
        MAX_CONNECTIONS_PER_ADDRESS,
        bind_listener,
        start_serving,
        stop_serving,
    )

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0, 256)
    port = sock.getsockname()[1]
    await start_serving(runner, [sock], 256)
    held = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_ADDRESS):
            held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)))
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        answer = await asyncio.wait_for(reader.read(), 10)  # (then closed)
        writer.close()
        return type(asyncio.get_running_loop()).__module__, answer
    finally:
        for _, w in held:
            w.close()
        await stop_serving(runner, [sock])


@pytest.mark.timeout(60)  # (before the fix, uvloop's refusal failed an assertion: no answer, and a hang)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_connection_over_the_per_address_bound_gets_its_sentence_on_either_loop(
    loop, monkeypatch, caplog
):
    from crowdtrain.protocol.serving import MAX_CONNECTIONS_PER_ADDRESS

    monkeypatch.setenv("CROWDTRAIN_LOOP", loop)
    caplog.set_level(logging.INFO)
    module, answer = _run(_over_the_bound)
    assert module.split(".")[0] == loop, module  # (the loop asked for ran)
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert (
        f"more than {MAX_CONNECTIONS_PER_ADDRESS} connections are open from your address".encode() in answer
    )
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures
