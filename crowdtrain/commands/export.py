"""``crowdtrain export RUN_ID --tracker URL --out model.safetensors``: the run's newest weights, to keep, with
``model.json`` beside them and, for a run whose data set was cut with a tokenizer, its ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from crowdtrain.commands.common import run_async, wants_json
from crowdtrain.protocol.errors import ConfigError, StateSyncError

if TYPE_CHECKING:  # imported where an export runs: the CLI starts without torch
    import torch

    from crowdtrain.protocol.messages import RunSpec, StateVersion

KEEPER_POLL_S = 2.0  # how often a keeper (--every) asks whether the state moved on


def resolved_args(recipe: str, args: dict) -> dict | None:
    """The recipe's full argument set for ``args`` (its ``validate_args``: every default filled in), or
    None where it cannot be known here: the recipe is not installed on this machine, or refuses ``args``
    (the weights are worth keeping all the same)."""
    from crowdtrain.protocol.errors import RecipeError
    from crowdtrain.volunteer.models.registry import get_recipe

    try:
        return dict(get_recipe(recipe).validate_args(args))
    except RecipeError:
        return None


def export_info(
    run_id: str, step: int, recipe: str, args: dict, content_hash: str, tokenizer: dict | None = None
) -> dict:
    """What ``model.json`` (and the weights' metadata) says of an export: the run, its global step, the
    recipe with its args as the run's spec writes them (``args``, what ``join --init-from`` compares) and
    as the recipe resolves them (``resolved_args``, the defaults filled in; None where the recipe is not
    installed here), the state's content hash and, for a run with one, its tokenizer (``file``, the name of
    the tokenizer.json beside, its ``sha256`` and ``vocab_size``)."""
    info = {
        "run_id": run_id,
        "step": step,
        "recipe": recipe,
        "args": dict(args),
        "resolved_args": resolved_args(recipe, args),
        "content_hash": content_hash,
    }
    if tokenizer is not None:
        info["tokenizer"] = tokenizer
    return info


def tokenizer_path(out: Path) -> Path:
    """Where an export to ``out`` writes the run's tokenizer: ``tokenizer.json`` beside it (unless that is
    the name of ``out``'s own .json)."""
    beside = out.with_name("tokenizer.json")
    return out.with_name(f"{out.stem}.tokenizer.json") if beside == out.with_suffix(".json") else beside


async def fetch_tokenizer(tracker, spec) -> bytes | None:
    """The run's tokenizer from its tracker, checked against the sha256 its data set's manifest names; None
    for a run whose data set has none."""
    from crowdtrain.protocol.errors import TrackerError
    from crowdtrain.protocol.messages import TokenizerInfo

    named = spec.dataset.manifest.tokenizer
    if not isinstance(named, TokenizerInfo):
        return None
    data = await tracker.get_tokenizer(spec.run_id)
    if data is None:
        raise TrackerError(
            f"the tracker at {tracker.url} has no tokenizer for run {spec.run_id}, though its data set names "
            "one; nothing was written"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != named.sha256:
        raise TrackerError(
            f"the tokenizer the tracker at {tracker.url} serves for run {spec.run_id} has sha256 {digest}, not "
            f"the {named.sha256} its data set names; nothing was written"
        )
    return data


async def export_state(run_id: str, tracker_url: str, out: Path, token: str | None, timeout_s: float) -> dict:
    """Fetch the newest state like a newcomer (several donors, verified ranges) and write its weights."""
    import asyncio

    from crowdtrain.protocol.messages import TokenizerInfo
    from crowdtrain.volunteer.state.snapshot import load_snapshot

    fetched = await _fetch_newest(run_id, tracker_url, token, timeout_s)
    loaded = await asyncio.to_thread(load_snapshot, fetched.state)
    named = fetched.spec.dataset.manifest.tokenizer
    about = None
    if fetched.tokenizer is not None and isinstance(named, TokenizerInfo):
        about = {"file": tokenizer_path(out).name, "sha256": named.sha256, "vocab_size": named.vocab_size}
    info = export_info(run_id, loaded.step, loaded.recipe, loaded.args, fetched.version.content_hash, about)
    await _write(out, info, fetched.tokenizer, loaded.model_state)
    return info


@dataclass(frozen=True, slots=True)
class _Fetched:
    """What an export takes from the run: its spec, its tokenizer (None for a run without one) and the bytes
    of its newest state, of ``version``."""

    spec: RunSpec
    tokenizer: bytes | None
    version: StateVersion
    state: bytes | Path


async def _fetch_newest(run_id: str, tracker_url: str, token: str | None, timeout_s: float) -> _Fetched:
    """The run's spec, tokenizer and newest state, fetched from its donors as a member: peers serve state only
    to run members, so the exporter joins in client mode and leaves again."""
    from crowdtrain import __version__
    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.credentials import SigningKey
    from crowdtrain.protocol.messages import PEER_PROTOCOL, JoinRequest, LeaveRequest
    from crowdtrain.volunteer.state.config import StateConfig
    from crowdtrain.volunteer.state.fetch import fetch_state

    key = SigningKey()
    async with TrackerClient(tracker_url, timeout_s=timeout_s) as tracker:
        spec = await tracker.get_spec(run_id)
        tokenizer = await fetch_tokenizer(tracker, spec)  # (first: a bad one is refused before the state)
        donors = await tracker.donors(run_id)
        if donors.state is None and donors.reason:
            raise StateSyncError(f"run {run_id}: {donors.reason}")
        if donors.state is None or not donors.donors:
            raise StateSyncError(
                f"no volunteer of run {run_id} serves its state right now; export while volunteers are online"
            )
        join = await tracker.join(
            run_id,
            JoinRequest(
                public_key=key.public_hex,
                token=token,
                device="cpu",
                client_version=__version__,
                peer_protocol=PEER_PROTOCOL,
            ),
        )
        try:
            data = await fetch_state(
                donors=donors.donors,
                version=donors.state,
                run_id=run_id,
                key=key,
                credential=join.credential,
                config=StateConfig(),
            )
        finally:
            await tracker.leave(run_id, LeaveRequest(peer_id=join.peer_id), key, join.credential)
    return _Fetched(spec, tokenizer, donors.state, data)


async def _write(
    out: Path, info: dict, tokenizer: bytes | None, model_state: dict[str, torch.Tensor]
) -> None:
    """The weights to ``out`` with ``info`` in their metadata, ``model.json`` and the tokenizer beside."""
    import asyncio

    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer_path(out).write_bytes(tokenizer)
    metadata = {"crowdtrain": json.dumps(info, sort_keys=True)}
    # written beside, then moved in place: a keeper's previous checkpoint stays whole until the new one is
    partial = out.with_name(out.name + ".partial")
    await asyncio.to_thread(
        save_file, {k: v.contiguous() for k, v in model_state.items()}, str(partial), metadata
    )
    os.replace(partial, out)
    out.with_suffix(".json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


async def keep_exporting(
    run_id: str, tracker_url: str, out: Path, token: str | None, timeout_s: float, every: int, say
) -> None:
    """A keeper: export the run's state each time it is ``every`` steps newer than the last one written,
    until interrupted, so the publisher holds the run's weights whatever its volunteers do (no GPU needed)."""
    import asyncio

    from crowdtrain.protocol.client import TrackerClient
    from crowdtrain.protocol.errors import TrackerUnreachable

    last: int | None = None
    said = ""
    while True:
        try:
            async with TrackerClient(tracker_url, timeout_s=timeout_s) as tracker:
                donors = await tracker.donors(run_id)
            if donors.state is not None and (last is None or donors.state.step >= last + every):
                info = await export_state(run_id, tracker_url, out, token, timeout_s)
                last = info["step"]
                say({**info, "out": str(out)}, f"wrote {out} (global step {last})")
                said = ""
            elif donors.state is None and said != "waiting":
                said = "waiting"
                say(None, f"no volunteer serves run {run_id}'s state right now; waiting for one")
        except (StateSyncError, TrackerUnreachable) as exc:
            if said != str(exc):  # said once, then tried again
                said = str(exc)
                say(None, f"{exc}; trying again")
        await asyncio.sleep(KEEPER_POLL_S)


def export(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., help="The run whose newest weights to fetch."),
    tracker: str = typer.Option(..., "--tracker", envvar="CROWDTRAIN_TRACKER", help="The run's tracker URL."),
    out: Path = typer.Option(
        ..., "--out", help="Where to write the weights (.safetensors); a .json sits beside."
    ),
    token: str | None = typer.Option(
        None, "--token", envvar="CROWDTRAIN_JOIN_TOKEN", help="Join token of a private run."
    ),
    timeout: float = typer.Option(10.0, "--timeout", help="Seconds to wait for the tracker per request."),
    json_out: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
    every: int | None = typer.Option(
        None,
        "--every",
        help="Keep exporting: rewrite --out each time the run's state is N steps newer, until Ctrl-C "
        "(a keeper of the run's weights; restore a run with `join --init-from`).",
    ),
) -> None:
    """Fetch the run's newest state from its volunteers and write the model weights with recipe and args."""
    if every is not None:
        if every < 1:
            raise ConfigError("--every", f"must be a whole number of steps ≥ 1, not {every}")
        as_json = wants_json(ctx, json_out)

        def say(info, line: str) -> None:
            if as_json:
                typer.echo(json.dumps(info if info is not None else {"notice": line}))
            else:
                typer.echo(line)

        run_async(keep_exporting(run_id, tracker.rstrip("/"), out, token, timeout, every, say))
        return
    info = run_async(export_state(run_id, tracker.rstrip("/"), out, token, timeout))
    if info["resolved_args"] is None:
        typer.echo(
            f"note: recipe {info['recipe']!r} is not installed here (or refuses the run's args), so "
            f"{out.with_suffix('.json')} holds its args as the run's spec writes them, without its defaults",
            err=True,
        )
    if wants_json(ctx, json_out):
        typer.echo(json.dumps({**info, "out": str(out)}))
    else:
        also = f", {tokenizer_path(out)}" if "tokenizer" in info else ""
        typer.echo(
            f"wrote {out} ({info['recipe']} at global step {info['step']}){also} and {out.with_suffix('.json')}"
        )
