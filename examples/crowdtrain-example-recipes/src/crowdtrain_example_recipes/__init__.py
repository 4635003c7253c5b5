"""Example crowdtrain model recipes: ``example-cnn`` (arrays) and ``example-lm`` (tokens).

Each is an ordinary ``torch.nn.Module`` wrapped with :func:`crowdtrain.volunteer.models.wrap` and registered in
this package's ``pyproject.toml`` under the ``crowdtrain.models`` entry-point group. ``data`` writes a toy data
set the CNN learns in a few dozen steps. The walk-through is ``docs/recipes.md`` in the crowdtrain repository.
"""

__version__ = "0.1.0"
