"""The volunteer: join flow, recipes, trainer, collaborative step, averaging, state sync and the view."""
