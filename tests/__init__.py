"""The test suite, a package: a test reaches a helper one way, ``from tests.<module> import …`` (pytest puts the
repository root on ``sys.path`` for a package's tests), and shared fixtures live in ``tests/conftest.py``."""
