"""Every exception class the product defines is one of the tree drawn in protocol/errors.py, and drawn there
under its real parent (issue 26): a reader finds every error crowdtrain raises on purpose in one picture."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import crowdtrain
from crowdtrain.protocol import errors
from crowdtrain.protocol.errors import CrowdtrainError

LAYERS = ("protocol", "datasets", "tracker", "volunteer")


def defined_exceptions() -> dict[str, type]:
    found = {}
    for layer in LAYERS:
        package = importlib.import_module(f"crowdtrain.{layer}")
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found[name] = obj
    return found


def drawn_parents() -> dict[str, str]:
    """``{class: parent}`` as the drawing in protocol/errors.py's docstring shows them (by indentation)."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in errors.__doc__.splitlines():
        match = re.match(r"^(\s*(?:[│ ]\s*)*(?:├── |└── )?)([A-Z][A-Za-z]+)\*?\s{2,}\S", line)
        if not match:
            continue
        depth = len(match[1])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parents[match[2]] = stack[-1][1]
        stack.append((depth, match[2]))
    return parents


def test_every_exception_the_product_defines_is_drawn_under_its_real_parent():
    assert crowdtrain.__name__ == "crowdtrain"
    defined = defined_exceptions()
    parents = drawn_parents()
    assert {"ApiError", "StateRefused", "NonFinite", "AdminAuthError"} <= set(defined)  # it did walk them
    for name, cls in defined.items():
        if name == "CrowdtrainError" or name.startswith("_"):  # the root; a module's own control flow
            continue
        if name == "BodyTooLong":  # protocol/aio's signal to its callers, which turn it into a sentence
            continue
        assert issubclass(cls, CrowdtrainError), f"{cls.__module__}.{name} is outside the tree"
        assert name in parents, f"{name} is not drawn in protocol/errors.py"
        assert cls.__mro__[1].__name__ == parents[name], (name, cls.__mro__[1].__name__, parents[name])
