"""State catch-up: snapshot a volunteer's state, serve it in verified ranges, fetch it from several donors.

* :mod:`~crowdtrain.volunteer.state.snapshot`: ``save_snapshot`` / ``load_snapshot`` (safetensors, no pickle);
* :mod:`~crowdtrain.volunteer.state.serve`: ``StateServer``, the ``/v1/state/...`` routes of the peer server;
* :mod:`~crowdtrain.volunteer.state.fetch`: ``fetch_state``, ranges from several donors with work-stealing;
* :mod:`~crowdtrain.volunteer.state.config`: ``StateConfig``.
"""
