"""``crowdtrain tracker serve``: run the tracker until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import typer

from crowdtrain.commands.common import run_async

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
    announce_interval: int = typer.Option(
        30, "--announce-interval", help="BitTorrent announce interval (s)."
    ),
    min_announce_interval: int = typer.Option(
        5, "--min-announce-interval", help="BitTorrent min interval (s)."
    ),
    join_rate: float = typer.Option(
        20.0, "--join-rate", help="Joins per second per client address; 0 = no limit."
    ),
    announce_rate: float = typer.Option(
        50.0, "--announce-rate", help="Announces and scrapes per second per client address; 0 = no limit."
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
        announce_rate_per_s=announce_rate,
    )
    run_async(_serve(config))


async def _serve(config) -> None:  # config: TrackerConfig
    from crowdtrain.tracker.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serve(config) as tracker:
            typer.echo(f"tracker listening on {tracker.url}")
            typer.echo(f"announce URL: {tracker.announce_url}")
            typer.echo(f"admin token: {tracker.admin_token}")
            typer.echo(f"database: {config.db}")
            await stop.wait()
            typer.echo("stopping the tracker")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    typer.echo("tracker stopped")
