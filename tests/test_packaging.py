"""The built wheel holds only ``crowdtrain/…`` and runs from where it is installed.

The wheel is built from a copy of the checkout (so no ``build/`` or ``*.egg-info`` lands in the tree
other people work in), installed with ``pip install --no-deps --target``, and run by this interpreter
from a temporary directory with ``-I`` (isolated mode: no cwd, no PYTHONPATH, no user site) and the
target directory put first on ``sys.path`` — ahead of the editable install's finder, which lives in
site-packages. The dependencies (typer, numpy, …) still come from the venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "tests", "bench"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "crowdtrain"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=110,
    )
    (built,) = out.glob("crowdtrain-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("target")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=110,
    )
    return target


def test_wheel_holds_only_the_crowdtrain_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    (dist_info,) = (t for t in tops if t.endswith(".dist-info"))
    assert dist_info.startswith("crowdtrain-")
    assert tops == {"crowdtrain", dist_info}, f"unexpected top-level entries: {sorted(tops)}"
    for path in [
        "crowdtrain/__init__.py",
        "crowdtrain/cli.py",
        "crowdtrain/protocol/__init__.py",
        "crowdtrain/protocol/frames.py",
        "crowdtrain/protocol/codecs.py",
        "crowdtrain/protocol/messages.py",
        "crowdtrain/protocol/credentials.py",
        "crowdtrain/tracker/__init__.py",
        "crowdtrain/volunteer/__init__.py",
        "crowdtrain/datasets/__init__.py",
    ]:
        assert path in names, f"{path} is missing from the wheel"
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "crowdtrain = crowdtrain.cli:main" in entry_points


def test_crowdtrain_version_runs_from_the_installed_wheel(installed, tmp_path):
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); sys.argv = ['crowdtrain', '--version']\n"
        "import crowdtrain, crowdtrain.protocol.frames, crowdtrain.cli\n"
        "print(json.dumps([crowdtrain.__file__, crowdtrain.protocol.frames.__file__, crowdtrain.__version__]))\n"
        "try:\n    crowdtrain.cli.main()\nexcept SystemExit as exc:\n    sys.exit(exc.code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(installed)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    first, rest = proc.stdout.split("\n", 1)
    pkg_file, frames_file, version = json.loads(first)
    assert Path(pkg_file).is_relative_to(installed), pkg_file
    assert Path(frames_file) == installed / "crowdtrain" / "protocol" / "frames.py"
    assert version in rest, f"`crowdtrain --version` printed {rest!r}"
