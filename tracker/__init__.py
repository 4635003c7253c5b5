"""The tracker service: runs, BitTorrent announce, volunteers, progress, matchmaking. Never imports torch.

Modules: ``config`` (TrackerConfig), ``server`` (aiohttp routes and ``serve()``), ``store`` (SQLite),
``collab`` (one run's volunteers, global step, matchmaking rounds, state donors), ``matchmaking`` (the pure
partition), ``reach`` (reachability checks of volunteers' declared addresses), ``announce`` and ``swarm``
(BitTorrent), ``auth`` (admin token, signed volunteer requests), ``metrics`` (Prometheus), ``page`` (the run's
live page). Its client is :mod:`crowdtrain.protocol.client`.
"""
