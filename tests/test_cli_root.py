"""The root command: version, help, and the exit-code rules."""

from __future__ import annotations

import subprocess

from crowdtrain import __version__


def run(python: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "crowdtrain", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_version_prints_the_package_version(python, cli_env):
    out = run(python, cli_env, "--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"crowdtrain {__version__}"


def test_unknown_option_is_a_usage_error_with_exit_2(python, cli_env):
    out = run(python, cli_env, "--no-such-option")
    assert out.returncode == 2
    assert "No such option" in out.stderr


def test_bad_log_level_is_a_usage_error(python, cli_env):
    out = run(python, cli_env, "--log-level", "LOUD", "--help")
    # --help is eager and wins; without it the bad level is refused
    assert out.returncode == 0
    out = run(python, cli_env, "--log-level", "LOUD", "no-such-command")
    assert out.returncode == 2
