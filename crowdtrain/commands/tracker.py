"""``crowdtrain tracker serve``: run the tracker until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
import socket

import typer

from crowdtrain.commands.common import run_async
from crowdtrain.protocol.errors import CrowdtrainError

app = typer.Typer(
    help="Run the tracker: BitTorrent announces, runs, volunteers, matchmaking.", no_args_is_help=True
)


@app.command("serve")
def serve_command(
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for every interface)."
    ),
    port: int = typer.Option(8470, "--port", help="TCP port; 0 picks a free one (printed on start)."),
    db: str | None = typer.Option(
        None,
        "--db",
        help="SQLite file for runs, tokens and history (default: the user data folder); :memory: for tests.",
    ),
    public_url: str | None = typer.Option(
        None, "--public-url", help="URL others reach this tracker at, if not the listening address."
    ),
    open_: bool = typer.Option(False, "--open", help="Serve announces for info-hashes nobody registered."),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        envvar="CROWDTRAIN_ADMIN_TOKEN",
        help="Admin token (default: stored in --db, or new).",
    ),
    peer_ttl: float = typer.Option(
        30.0, "--peer-ttl", help="Seconds of silence after which a volunteer is dropped."
    ),
    heartbeat_interval: float = typer.Option(2.0, "--heartbeat-interval", help="Seconds between heartbeats."),
    announce_interval: int = typer.Option(30, "--announce-interval", help="BitTorrent interval (s)."),
    min_announce_interval: int = typer.Option(5, "--min-announce-interval", help="BitTorrent min interval."),
    max_per_address: int = typer.Option(8, "--max-per-address", help="Volunteers of a run per IP (/64)."),
    join_rate: float = typer.Option(
        20.0, "--join-rate", help="Joins per second per client address; 0 = no limit."
    ),
    announce_rate: float = typer.Option(
        50.0, "--announce-rate", help="Announces and scrapes per second per client address; 0 = no limit."
    ),
    allow_other_hosts: bool = typer.Option(
        False, "--allow-other-hosts", help="Check volunteers at hosts they do not send from (relays)."
    ),
) -> None:
    """Start a tracker; prints its URL, announce URL and admin token, then serves until Ctrl-C."""
    from crowdtrain.tracker.config import TrackerConfig, default_db_path

    config = TrackerConfig(
        host=host,
        port=port,
        db=db if db is not None else str(default_db_path()),
        public_url=public_url,
        open=open_,
        admin_token=admin_token,
        peer_ttl_s=peer_ttl,
        heartbeat_interval_s=heartbeat_interval,
        announce_interval_s=announce_interval,
        min_announce_interval_s=min_announce_interval,
        join_rate_per_s=join_rate,
        max_peers_per_address=max_per_address,
        announce_rate_per_s=announce_rate,
        allow_other_hosts=allow_other_hosts,
    )
    run_async(_serve(config))


def this_machine_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses, one per interface that has one (Linux; else [])."""
    import fcntl
    import struct

    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                )  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            ip = socket.inet_ntoa(packed[20:24])
            if not ip.startswith("127.") and ip not in found:
                found.append(ip)
    return found


def address_lines(config, tracker) -> list[str]:
    """What a publisher needs to tell others: URLs they can use (not 0.0.0.0), and the announce URL."""
    if config.host not in ("0.0.0.0", "::", "") or config.public_url:
        base = (config.public_url or tracker.url).rstrip("/")
        return [
            f"tracker listening on {tracker.url}",
            f"announce URL: {tracker.announce_url}",
            f"runs on the web: {base}/",
        ]
    lines = [f"tracker listening on every interface, port {tracker.port}; on this machine: {tracker.url}"]
    others = [f"http://{ip}:{tracker.port}" for ip in this_machine_addresses()]
    if others:
        lines.append(
            f"others reach it at: {', '.join(others)} (or pass --public-url if they come another way)"
        )
    else:
        lines.append(
            "this machine has no network address but loopback; pass --public-url with the URL others use"
        )
    lines.append(
        f"announce URL: {tracker.announce_url.replace(tracker.url, others[0]) if others else tracker.announce_url}"
    )
    lines.append(f"runs on the web: {others[0] if others else tracker.url}/")
    return lines


# A tracker's heap is mostly long-lived (runs, peers, the steps formed) while each request makes short-lived
# objects; with two long-polls per volunteer in flight, those outlive young collections, and the default
# thresholds then run a full collection about once a step over a heap that grows with the run: the one cost
# per step that grew faster than its volunteers (bench/steps.py: 188 of 878 ms CPU per step at 1,000
# volunteers). Everything built at start-up is frozen out of collection, and collections run 70× less often.
GC_THRESHOLDS = (50_000, 20, 10)


def _tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _serve(config) -> None:  # config: TrackerConfig
    from crowdtrain.tracker.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serve(config) as tracker:
            _tune_gc()
            for line in address_lines(config, tracker):
                typer.echo(line)
            typer.echo(f"admin token: {tracker.admin_token}")
            typer.echo(f"database: {config.db}")
            await stop.wait()
            typer.echo("stopping the tracker")
    except* OSError as group:  # (the tracker's task group wraps what its start raised)
        exc = group.exceptions[0]
        if not isinstance(exc, OSError) or exc.errno not in (
            errno.EADDRINUSE,
            errno.EADDRNOTAVAIL,
            errno.EACCES,
        ):
            raise
        reason = {errno.EADDRINUSE: "the port is in use", errno.EACCES: "permission denied"}.get(
            exc.errno, "no interface has that address"
        )
        raise CrowdtrainError(
            f"cannot listen on {config.host}:{config.port} ({reason}); choose another --port or --host"
        ) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    typer.echo("tracker stopped")
