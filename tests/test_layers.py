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


# Every layer, as a whole: one interpreter imports every module of it (issue 15). protocol ← datasets ←
# tracker, volunteer ← crowdtrain commands; the tracker never imports torch, rich or libtorrent; the engine
# never imports rich (the views do).
UPPER = {"crowdtrain.commands", "crowdtrain.cli", "crowdtrain.publisher", "typer"}
LAYERS = [
    ("crowdtrain.protocol", (), {"crowdtrain.datasets", "crowdtrain.tracker", "crowdtrain.volunteer", "torch",
                                "rich", "libtorrent"} | UPPER),
    ("crowdtrain.datasets", (), {"crowdtrain.tracker", "crowdtrain.volunteer", "torch", "rich"} | UPPER),
    ("crowdtrain.tracker", (), {"crowdtrain.volunteer", "torch", "rich", "libtorrent"} | UPPER),
    ("crowdtrain.volunteer", ("crowdtrain.volunteer.view",), {"crowdtrain.tracker", "rich"} | UPPER),
    ("crowdtrain.volunteer", (), {"crowdtrain.tracker"} | UPPER),
]  # fmt: skip


def layer_imports(package: str, leave_out: tuple[str, ...]) -> tuple[list[str], set[str]]:
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "names = sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'))\n"
        f"names = [n for n in names if not n.startswith({leave_out!r})]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(' '.join(names)); print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    first, _, rest = out.stdout.partition("\n")
    loaded = set(rest.split())
    return first.split(), loaded | {name.split(".")[0] for name in loaded}


@pytest.mark.parametrize(("package", "leave_out", "forbidden"), LAYERS)
def test_no_layer_imports_a_layer_above_it(package, leave_out, forbidden):
    modules, loaded = layer_imports(package, leave_out)
    assert len(modules) >= 3, modules  # it did walk the package
    leaked = loaded & forbidden  # (a package is in sys.modules whenever one of its modules is)
    assert not leaked, f"importing every module of {package} (but {leave_out}) loads {sorted(leaked)}"
