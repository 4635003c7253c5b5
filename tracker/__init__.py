"""The tracker service: runs, BitTorrent announce, volunteers, progress, matchmaking. Never imports torch.

Modules: ``config`` (TrackerConfig), ``server`` (aiohttp routes and ``serve()``), ``client``
(TrackerClient), ``store`` (SQLite), ``collab`` (one run's volunteers, global step, matchmaking rounds),
``matchmaking`` (the pure partition), ``announce`` and ``swarm`` (BitTorrent), ``auth`` (admin token,
signed volunteer requests), ``metrics`` (Prometheus), ``fixtures`` (real small things for tests and demos).
"""
