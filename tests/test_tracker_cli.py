"""`crowdtrain run create SPEC.toml` and `crowdtrain status RUN` against a real tracker."""

from __future__ import annotations

import asyncio
import json

import pytest

from crowdtrain.protocol import bencode
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.messages import RunCreated, RunStatus, decode, encode
from tests.harness import cli, closed_port
from tests.sim import SimVolunteer, make_run_create, make_torrent

SPEC = """
name = "tiny lm on stdlib"
target_batch_size = 256
micro_batch_size = 4
join_policy = "public"
seed = 7

[model]
recipe = "tiny-gpt"
param_hash = "{param_hash}"
[model.args]
n_layer = 2
dropout = 0.0

[dataset]
dir = "data"

[optimizer]
name = "adamw"
lr = 0.0006

[schedule]
kind = "cosine"
warmup_steps = 10
total_steps = 500

[averaging]
group_size = 4
codec = "int8"
"""


def write_dataset(folder, announce):
    folder.mkdir()
    base = make_run_create()  # its manifest describes a 40000-byte set
    (folder / "manifest.json").write_bytes(encode(base.dataset.manifest))
    torrent = make_torrent("demo", b"x" * 40000, announce=announce)
    (folder / "demo.torrent").write_bytes(torrent)
    return torrent


async def test_run_create_reads_the_toml_and_the_dataset_folder(tracker, tmp_path, cli_env):
    torrent = write_dataset(tmp_path / "data", tracker.announce_url)
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(param_hash="ef" * 32))
    out = await cli(
        cli_env,
        "run",
        "create",
        str(spec),
        "--tracker",
        tracker.url,
        "--admin-token",
        tracker.admin_token,
        "--json",
    )
    assert out.returncode == 0, out.stderr
    created = decode(out.stdout.strip(), RunCreated)
    s = created.spec
    assert s.name == "tiny lm on stdlib" and s.seed == 7 and s.target_batch_size == 256
    assert (s.model.recipe, s.model.args, s.model.param_hash) == (
        "tiny-gpt",
        {"n_layer": 2, "dropout": 0.0},
        "ef" * 32,
    )
    assert s.dataset.infohash == bencode.infohash_v1(torrent)
    assert s.dataset.manifest.name == "demo"
    assert (s.optimizer.lr, s.schedule.warmup_steps, s.averaging.codec) == (0.0006, 10, "int8")
    assert s.tracker_public_key == tracker.public_key
    async with TrackerClient(tracker.url) as c:
        assert await c.get_torrent(created.run_id) == torrent

    plain = await cli(
        cli_env, "run", "create", str(spec), "--tracker", tracker.url, "--admin-token", tracker.admin_token
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().startswith("tiny-lm-on-stdlib-")


async def test_run_create_errors_are_one_sentence_and_exit_1(tracker, tmp_path, cli_env):
    write_dataset(tmp_path / "data", tracker.announce_url)
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(param_hash="ef" * 32).replace("seed = 7", "seed = 7\ncolour = 'red'"))
    out = await cli(
        cli_env, "run", "create", str(spec), "--tracker", tracker.url, "--admin-token", tracker.admin_token
    )
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: SPEC: {spec}: RunCreate: Object contains unknown field `colour`"

    spec.write_text(SPEC.format(param_hash="ef" * 32))
    out = await cli(
        cli_env, "run", "create", str(spec), "--tracker", tracker.url, "--admin-token", "wrong-token-123456"
    )
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        == "error: the admin token is wrong; use the token the tracker printed when it started"
    )

    spec.write_text(SPEC.format(param_hash="ef" * 32).replace('dir = "data"', 'dir = "missing"'))
    out = await cli(
        cli_env, "run", "create", str(spec), "--tracker", tracker.url, "--admin-token", tracker.admin_token
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: dataset.dir: cannot read ")

    spec.write_text("name = [")
    out = await cli(
        cli_env, "run", "create", str(spec), "--tracker", tracker.url, "--admin-token", tracker.admin_token
    )
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: SPEC: {spec} is not valid TOML")


async def test_status_prints_progress_as_text_and_json(tracker, cli_env):
    async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as c:
        run_id = (await c.create_run(make_run_create("watched", target_batch_size=100))).run_id
        v = SimVolunteer(c, run_id)
        await v.join()
        await asyncio.sleep(0.5)  # 25 samples at 12.5/s: a claim the tracker credits only after a while
        await v.heartbeat(0, 25, samples_per_s=12.5)
    out = await cli(cli_env, "status", run_id, "--tracker", tracker.url, "--json")
    assert out.returncode == 0, out.stderr
    status = decode(out.stdout.strip(), RunStatus)
    assert (status.global_step, status.samples, status.target, status.peers_online) == (0, 25, 100, 1)
    assert status.samples_per_s == 12.5 and status.eta_s == 6.0
    text = await cli(cli_env, "status", run_id, "--tracker", tracker.url)
    assert text.returncode == 0, text.stderr
    assert f"run {run_id} (watched)" in text.stdout
    assert "samples       25 / 100 (25 %)" in text.stdout
    assert "peers online  1" in text.stdout
    assert f"mode          every step averages a gradient, codec {status.codec}" in text.stdout
    assert v.peer_id in text.stdout
    missing = await cli(cli_env, "status", "nope", "--tracker", tracker.url)
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        == "error: there is no run 'nope' on this tracker; list runs with GET /api/v1/runs"
    )
    down = await cli(
        cli_env, "status", run_id, "--tracker", f"http://127.0.0.1:{closed_port()}", "--timeout", "2"
    )
    assert down.returncode == 1
    assert "check --tracker or your network." in down.stderr
    assert json.loads(out.stdout)["run_id"] == run_id


@pytest.mark.slow  # imports torch twice (the CLI builds the recipe)
async def test_run_create_computes_the_param_hash_when_the_spec_omits_it(tracker, tmp_path, cli_env):
    torch_recipes = pytest.importorskip("crowdtrain.volunteer.models.registry")
    from crowdtrain.datasets.make import make_dataset
    from crowdtrain.volunteer.models.preflight import initial_hash
    from crowdtrain.volunteer.models.recipe import param_hash

    # a real data set: `run create` runs one of its micro-batches through the recipe
    make_dataset("builtin:stdlib", tmp_path / "data", chunk_bytes=64 * 1024, max_bytes=64 * 1024)
    recipe = torch_recipes.get_recipe("tiny-gpt")  # a tokens recipe, as the data set
    spec = tmp_path / "run.toml"
    spec.write_text(
        f'name = "hashless"\ntarget_batch_size = 32\n[model]\nrecipe = "{recipe.name}"\n[dataset]\ndir = "data"\n'
    )
    out = await cli(
        cli_env,
        "run",
        "create",
        str(spec),
        "--tracker",
        tracker.url,
        "--admin-token",
        tracker.admin_token,
        "--json",
    )
    assert out.returncode == 0, out.stderr
    created = decode(out.stdout.strip(), RunCreated)
    assert created.spec.model.param_hash == param_hash(recipe.build({}))
    assert created.spec.model.init_hash == initial_hash(recipe.build({}))
    assert created.spec.model.args == recipe.validate_args({})  # the defaults, pinned in the spec


def test_status_escapes_control_characters_a_tracker_of_an_earlier_version_stored():
    """Issue 16: names are checked at creation now, but a run stored before that may hold NUL, CR/LF, ESC
    or U+202E; `crowdtrain status` prints them as escapes, never raw (no forged lines, no cursor moves)."""
    from crowdtrain.commands.status import format_status
    from crowdtrain.protocol.messages import RunStatus

    status = RunStatus(
        run_id="r-1",
        name="evil\x00\r\n  global step   999\x1b[2J\u202eexe",
        global_step=1,
        samples=0,
        target=8,
        eta_s=None,
        peers_online=0,
        samples_per_s=0.0,
        peers=[],
        recent_steps=[],
        notice="bad\rnotice",
    )
    text = format_status(status)
    assert "\\x00\\r\\n  global step   999\\x1b[2J\\u202eexe" in text and "bad\\rnotice" in text
    assert not any(ch in text for ch in "\x00\r\x1b\u202e")
    assert [line for line in text.splitlines() if line.startswith("  global step")] == ["  global step   1"]


def test_status_shows_the_credit_ledger_and_a_backbone():
    from crowdtrain.commands.status import format_status
    from crowdtrain.protocol.messages import CreditRecord, PeerStatus, RunStatus

    backbone = PeerStatus(
        peer_id="bb01", step=3, samples=0, samples_per_s=0.0, client_mode=False, chunks_held=4,
        address="203.0.113.7:41234", reachable=True, backbone=True, upload_bps=2.5e6,
    )  # fmt: skip
    status = RunStatus(
        run_id="r-1", name="run", global_step=3, samples=0, target=8, eta_s=None, peers_online=1,
        samples_per_s=0.0, peers=[backbone], recent_steps=[],
        credits=[CreditRecord(public_key="ab" * 32, samples=1234, steps=3, last_step=2, verified=2),
                 CreditRecord(public_key="cd" * 32, samples=0, steps=3, last_step=2, rejected=1)],
        spot_checked=True,  # (a run that draws no checks shows no check columns: tests/test_view.py)
    )  # fmt: skip
    lines = format_status(status).splitlines()
    assert any(line.endswith("backbone, reachable at 203.0.113.7:41234") for line in lines), lines
    assert any("2.5 MB/s" in line and "upload" not in line for line in lines), lines  # its measured uplink
    start = lines.index(
        "  credit ledger (samples of each volunteer key that entered the averages; spot-checks):"
    )
    assert lines[start + 1].split()[-2:] == ["verified", "rejected"]
    assert lines[start + 2].split() == ["abababababababab…", "1,234", "3", "2", "2", "0"]
    assert lines[start + 3].split() == ["cdcdcdcdcdcdcdcd…", "0", "3", "2", "0", "1"]
