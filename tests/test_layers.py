"""One-way imports: protocol knows nothing of the rest; the tracker never imports torch, rich or libtorrent."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return {name.split(".")[0] for name in out.stdout.split()} | set(out.stdout.split())


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        (
            "crowdtrain.protocol.messages",
            {
                "torch",
                "aiohttp",
                "rich",
                "libtorrent",
                "crowdtrain.tracker",
                "crowdtrain.volunteer",
                "crowdtrain.datasets",
            },
        ),
        ("crowdtrain.protocol.frames", {"torch", "aiohttp", "rich", "libtorrent"}),
        ("crowdtrain.protocol.credentials", {"torch", "aiohttp", "rich", "libtorrent"}),
    ],
)
def test_module_does_not_import_forbidden_layers(module, forbidden):
    leaked = imported_after(module) & forbidden
    assert not leaked, f"{module} imports {sorted(leaked)}"
