"""The volunteer's terminal view, built from the engine's events alone.

``state`` folds events into a :class:`~crowdtrain.volunteer.view.state.ViewState` snapshot, one record per
panel (``panels``), each moved by its own table of pure rules (``rules``); ``render`` turns a snapshot into
rich panels (a pure function); ``sentences`` gives each event's sentence, which ``lines`` prints as the
``--plain`` line (beside the ``--json`` one); ``live`` holds
:class:`~crowdtrain.volunteer.view.live.ViewSink`, the consumer the engine emits into. The engine never
imports this package.
"""
