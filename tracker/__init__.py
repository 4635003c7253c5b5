"""The tracker service: runs, BitTorrent announce, volunteers, progress, matchmaking. Never imports torch.

Modules:

* service: ``config`` (TrackerConfig), ``server`` (the aiohttp app, public routes, ``serve()``),
  ``volunteers`` and ``admin`` (their routes), ``replies`` (JSON/HTML replies, ``ApiError``), ``auth``
  (admin token, signed volunteer requests), ``metrics`` (Prometheus), ``page`` (the live pages);
* runs: ``runs`` (one record per run: live state, torrent, join token), ``store`` (the ``RunStore``
  protocol and its SQLite implementation);
* one run's collaboration: ``collab`` (``RunState``: its volunteers, closing a step, forming its round),
  ``ledger`` (the share ledger: credit, allotments, computing ahead; pure), ``matchmaking`` (the pure
  partition), ``rounds`` (signed assignments, formed steps kept), ``donors`` (who serves the state),
  ``reach`` (reachability of volunteers' declared addresses);
* BitTorrent: ``announce`` and ``swarm``.

Its client is :mod:`crowdtrain.protocol.client`.
"""
