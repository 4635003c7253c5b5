"""The volunteer's terminal view, built from the engine's events alone.

``state`` folds events into a :class:`~crowdtrain.volunteer.view.state.ViewState` snapshot; ``render``
turns a snapshot into rich panels (a pure function); ``lines`` gives the ``--plain`` and ``--json`` line
forms; ``live`` holds :class:`~crowdtrain.volunteer.view.live.ViewSink`, the consumer the engine emits
into. The engine never imports this package.
"""
