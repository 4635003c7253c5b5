"""The volunteer's view: panels rendered from a scripted run, the --plain and --json lines, and ViewSink."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import math
import re
import threading
import time

import pytest
from rich.console import Console

from crowdtrain.protocol.errors import ConfigError, ProtocolError
from crowdtrain.protocol.messages import replace as msgspec_replace
from crowdtrain.volunteer import events as ev
from crowdtrain.volunteer.view.demo import DemoRow, render_demo
from crowdtrain.volunteer.view.fmt import fmt_bytes, fmt_duration, fmt_eta, fmt_rate, fmt_ratio, fmt_uptime
from crowdtrain.volunteer.view.lines import (
    EVENT_TYPES,
    LineThrottle,
    json_line,
    parse_json_line,
    plain_line,
    stamp,
)
from crowdtrain.volunteer.view.live import ViewSink, choose_mode
from crowdtrain.volunteer.view.render import bar, render, sparkline
from crowdtrain.volunteer.view.state import ViewState, apply, fold

T0 = 1_800_000_000.0  # a fixed start time: every figure below is deterministic


def script() -> list[ev.Event]:
    """A volunteer's first minutes: join late, catch up from donors (one banned), fetch data, train, average."""
    return [
        ev.Joined(
            t=T0,
            run_id="r-7f3a",
            run_name="tiny-shakespeare",
            tracker="http://127.0.0.1:8471",
            peer_id="p-carol",
            device="cpu",
            address="127.0.0.1:40123",
            global_step=40,
            target_batch_size=256,
            recipe="tiny-gpt",
            codec="int8",
        ),
        ev.PhaseChanged(t=T0 + 1, phase="catching-up"),
        ev.StateSyncStarted(
            t=T0 + 1,
            step=40,
            content_hash="ab12cd34ef56aa77",
            total_bytes=8_000_000,
            donors=("p-alice", "p-bob"),
        ),
        ev.StateSyncProgress(
            t=T0 + 2,
            done_bytes=2_000_000,
            total_bytes=8_000_000,
            rate=1_000_000.0,
            donors_active=2,
            eta_s=6.0,
        ),
        ev.DonorBanned(t=T0 + 3, donor="p-bob", reason="part 3 failed its hash check"),
        ev.StateLoaded(
            t=T0 + 8, step=40, content_hash="ab12cd34ef56aa77", duration_s=7.0, donors_used=("p-alice",)
        ),
        ev.ChunkVerified(t=T0 + 9, index=11, name="chunk-00011", samples=512, held=12, total=40),
        ev.TorrentStats(
            t=T0 + 10,
            chunks_held=12,
            chunks_total=40,
            download_rate=1_234_000.0,
            upload_rate=345_000.0,
            peers=3,
            seeds=1,
            downloaded=6_000_000,
            uploaded=1_500_000,
            progress=0.3,
        ),
        ev.PhaseChanged(t=T0 + 10, phase="training"),
        ev.LocalTraining(t=T0 + 11, loss=4.25, samples=32, samples_per_s=12.5, micro_batches=4),
        ev.LocalTraining(
            t=T0 + 12, loss=3.9876, samples=64, samples_per_s=12.75, micro_batches=8, compute_share=0.8
        ),
        ev.Progress(
            t=T0 + 13,
            global_step=41,
            samples=96,
            target=256,
            peers_online=3,
            samples_per_s=40.1,
            eta_s=4.0,
            reachable=True,
        ),
        ev.PhaseChanged(t=T0 + 14, phase="averaging"),
        ev.RoundDone(
            t=T0 + 15,
            round_id="rd-41",
            kind="grad",
            step=41,
            members=("p-alice", "p-bob", "p-carol"),
            my_part=2,
            bytes_sent=400_000,
            bytes_received=410_000,
            raw_bytes=3_000_000,
            duration_s=1.5,
            phases={"encode": 0.1, "exchange": 1.3, "decode": 0.1},
            dropped=("p-bob",),
            rejected=(),
            clipped=("p-alice",),
            failed_parts=(1,),
        ),
        ev.StepDone(
            t=T0 + 16,
            step=41,
            lr=3e-4,
            contributed_samples=96,
            group_samples=256,
            step_time_s=6.4,
            loss=2.3141,
            compute_s=5.5,
            compute_share=0.87,
        ),
        ev.StepMissed(t=T0 + 30, step=42, now_step=44, dropped_samples=48),
        ev.RoundFailed(t=T0 + 31, round_id="rd-44", step=44, reason="group had 1 member"),
        ev.AnswerRefused(
            t=T0 + 31,
            round_id="rd-45",
            step=45,
            owner="p-evil",
            part=2,
            reason="the answer is not the mean of the copies listed",
            proven=True,
            tracker="barred",
        ),
        ev.MemberPulling(
            t=T0 + 31, round_id="rd-46", step=46, member="p-pull", alignment=-0.84, tracker="counted"
        ),
        ev.LogLine(t=T0 + 32, level="warning", message="tracker answered slowly (2.1 s)"),
        ev.StateServed(t=T0 + 33, step=41, content_hash="99aa88bb77cc66dd", size=8_000_000),
        ev.Evaluated(
            t=T0 + 33, step=40, loss=2.5012, metrics={"accuracy": 0.4375}, samples=256, duration_s=0.4
        ),
        ev.Reachability(
            t=T0 + 33,
            address="127.0.0.1:40123",
            reachable=True,
            bt_address="127.0.0.1:6881",
            bt_reachable=False,
            asked_client_mode=False,
        ),
        ev.PortMapped(t=T0 + 33, what="peer server", port=40123, via="UPnP", external_port=40123),
        ev.RunNotice(t=T0 + 33, message="the tracker found a problem with this run"),
        ev.Left(t=T0 + 65, reason="interrupted"),
    ]


def record(renderable, width: int = 100) -> str:
    console = Console(width=width, color_system=None, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def has(text: str, pattern: str) -> bool:
    """``pattern`` with any run of spaces where it has one space (panel columns pad labels)."""
    return re.search(r"\s+".join(map(re.escape, pattern.split(" "))), text) is not None


# ------------------------------------------------------------ the scripted run


def test_script_covers_every_event_type():
    assert {type(e) for e in script()} == set(EVENT_TYPES.values())


def test_render_shows_each_panels_figures():
    state = fold(script()[:-1])  # everything but Left
    text = record(render(state))
    for pattern in [
        # header
        "crowdtrain · tiny-shakespeare",
        "run r-7f3a",
        "peer p-carol",
        "tracker http://127.0.0.1:8471",
        "device cpu",
        "reachable at 127.0.0.1:40123",
        "up 33s",
        "reachable for averaging at 127.0.0.1:40123; BitTorrent port 6881 is not reachable",
        "run: the tracker found a problem with this run",
        # collaboration
        "global step 44",
        "96/256",
        "peers online 3",
        "run speed 40.1 samples/s",
        "step time 6.40 s",
        "next step in 4.00 s",
        # local training
        "loss 3.9876 █▁",
        "speed 12.8 samples/s",
        "compute 87%",
        "this step 0 samples",  # the missed step dropped its 48,
        "my share 38% (last 1 step)",
        "steps 1 done, 1 missed (48 dropped)",
        "lr 0.0003",
        "held-out 2.5012 (step 40)",
        "accuracy 0.4375",
        # data set
        "12/40",
        "down 1.2 MB/s (6.0 MB in all)",
        "up 345 kB/s (1.5 MB in all)",
        "swarm 3 peers, 1 seed",
        "seed ratio 0.25",
        # state sync
        "state step 42",
        "lag 2 steps behind",
        "caught up in 7.00 s",
        "serving step 41 (8.0 MB)",
        "donors banned p-bob: part 3 failed",
        # averaging
        "phase averaging",
        "grad round for step 41, 1.50 s, 3 members",
        "members p-alice, p-bob, p-carol (I own part 2)",
        "sent 400 kB, received 410 kB, 7.5× smaller than fp32",
        "encode 0.10 s, exchange 1.30 s, decode 0.10 s",
        "dropped p-bob; clipped p-alice; failed parts 1",
        "rounds 1 done, 1 failed, 7.5× overall",
        "last failure step 44: group had 1 member",
        # recent log lines
        "WARNING tracker answered slowly (2.1 s)",
        # (the round failed at step 44 and the refused answer of step 45 are older than the panel's six)
        "WARNING step 46: member p-pull's copy points against the others' (cosine -0.84)",
    ]:
        assert has(text, pattern), f"{pattern!r} not on screen:\n{text}"
    for title in ("collaboration", "local training", "data set", "state sync", "averaging", "recent"):
        assert f"─ {title} ─" in text
    assert "████▌░░░░░░░░░░░ 12/40" in text  # 12 of 40 chunks as a bar
    assert "██████░░░░░░░░░░ 96/256" in text  # 96 of 256 samples toward the target


def test_render_while_catching_up_shows_download_progress():
    state = fold(script()[:4])  # joined late, state download a quarter done
    text = record(render(state))
    assert state.sync.syncing
    assert has(text, "catching up ████░░░░░░░░░░░░ 2.0 MB/8.0 MB")
    assert has(text, "download 1.0 MB/s, eta 6.00 s, 2 donors")
    assert has(text, "phase catching-up")
    assert has(text, "global step 40")

    loaded = fold(script()[4:6], state)  # a donor banned, then the state arrives
    text = record(render(loaded))
    assert not loaded.sync.syncing
    assert has(text, "state step 40 · ab12cd34ef56")
    assert has(text, "lag 0 steps (in sync)")
    assert "catching up" not in text


def test_render_after_leaving_and_before_joining():
    text = record(render(fold(script())))
    assert has(text, "left interrupted")
    assert has(text, "left the run: interrupted")
    assert has(text, "up 1m 05s")
    empty = record(render(ViewState()))
    assert "joining the run…" in empty
    assert has(empty, "last round none yet")
    assert "nothing yet" in empty


@pytest.mark.parametrize("width", [80, 100, 120])
def test_render_fits_terminal_widths(width):
    text = record(render(fold(script()[:-1])), width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert lines[0].startswith("╭─ crowdtrain · tiny-shakespeare") and lines[0].endswith("╮")
    for figure in ("12/40", "96/256", "7.5×", "1.2 MB/s", "3.9876", "p-carol"):
        assert figure in text, f"{figure} missing at width {width}"


def test_render_is_pure_and_now_only_moves_the_uptime():
    state = fold(script()[:-1])
    before = dataclasses.asdict(state)
    assert record(render(state)) == record(render(state))
    later = record(render(state, now=T0 + 3725))
    assert has(later, "up 1h 02m")
    now_text = record(render(state))
    assert has(now_text, "up 33s")
    assert now_text.splitlines()[3:] == later.splitlines()[3:]  # only the header changed
    assert dataclasses.asdict(state) == before


# ------------------------------------------------------------ folding events


def test_apply_returns_a_new_snapshot():
    state = ViewState()
    joined = script()[0]
    after = apply(state, joined)
    assert state == ViewState() and after is not state
    header, collab = after.header, after.collab
    assert (header.peer_id, collab.global_step, collab.target, header.joined_at) == ("p-carol", 40, 256, T0)
    # joined at step 40: unknown until state loads
    assert after.training.local_step is None and after.lag is None


def test_derived_figures_over_recent_steps():
    steps = [
        ev.StepDone(t=T0 + i, step=i, lr=1e-3, contributed_samples=c, group_samples=100, step_time_s=s)
        for i, (c, s) in enumerate([(10, 2.0), (30, 4.0), (50, 6.0)])
    ]
    state = fold(steps)
    assert state.training.contribution_share == pytest.approx(0.3)
    assert state.training.step_time_s == pytest.approx(4.0)
    assert (state.training.local_step, state.collab.global_step, state.lag) == (3, 3, 0)
    state = apply(
        state,
        ev.Progress(
            t=T0 + 9,
            global_step=7,
            samples=0,
            target=100,
            peers_online=2,
            samples_per_s=1.0,
            eta_s=None,
            reachable=False,
        ),
    )
    assert state.lag == 4
    assert has(record(render(state)), "lag 4 steps behind")
    assert has(record(render(state)), "peers online 2 (this machine is not reachable)")
    many = fold(
        ev.StepDone(t=T0 + i, step=i, lr=1e-3, contributed_samples=1, group_samples=4, step_time_s=1.0)
        for i in range(50)
    ).training
    assert len(many.recent_steps) == 10 and many.recent_steps[-1].step == 49 and many.steps_done == 50


def step_done(share: float | None, t: float = T0) -> ev.StepDone:
    return ev.StepDone(
        t=t, step=3, lr=1e-3, contributed_samples=24, group_samples=96, step_time_s=2.0, compute_share=share
    )


def local_training(share: float | None, t: float = T0) -> ev.LocalTraining:
    return ev.LocalTraining(t=t, loss=2.5, samples=8, samples_per_s=4.0, micro_batches=2, compute_share=share)


def test_compute_share_in_the_plain_lines():
    assert plain_line(step_done(0.87)).endswith(", 2.00 s, compute 87%")
    assert plain_line(step_done(None)).endswith(", 2.00 s, compute —")
    assert plain_line(step_done(1.0)).endswith(", compute 100%")
    assert plain_line(local_training(0.5)).endswith("2 micro-batches, compute 50%")
    assert plain_line(local_training(None)).endswith("2 micro-batches, compute —")
    for event in (step_done(0.87), step_done(None), local_training(0.5)):
        assert "\n" not in plain_line(event)  # one event, one line
        assert parse_json_line(json_line(event)) == event
    assert json.loads(json_line(step_done(None)))["compute_share"] is None


def test_the_step_line_shows_the_loss_of_the_step():
    """Issue 25: the plain step line left out the loss the StepDone event carries."""
    with_loss = dataclasses.replace(step_done(0.87), loss=2.31415)
    assert ", loss 2.314, lr 0.001, " in plain_line(with_loss)
    assert "loss" not in plain_line(step_done(0.87))  # a step that knows no loss says nothing of it
    assert ", loss nan, " in plain_line(dataclasses.replace(with_loss, loss=math.nan))
    assert parse_json_line(json_line(with_loss)) == with_loss


def progress(eta_s: float | None, samples_per_s: float) -> ev.Progress:
    return ev.Progress(
        t=T0, global_step=3, samples=4, target=128, peers_online=2, samples_per_s=samples_per_s,
        eta_s=eta_s, reachable=True,
    )  # fmt: skip


def test_absurd_etas_are_shown_as_unknown_and_durations_in_human_units():
    """Issue 25: ETAs of 140737488355328.0 s (what is left of a step over a rate of float dust)."""
    dust = 2.0**-45  # 0.1 + 0.2 - 0.1 - 0.2 and the like
    assert fmt_eta(4 / dust, dust) == "—"
    for absurd in (math.inf, math.nan, -1.0, 31 * 86_400.0, 2.0**47, None):
        assert fmt_eta(absurd) == "—", absurd
    assert fmt_eta(6.0, 0.0) == fmt_eta(6.0, 1e-12) == fmt_eta(6.0, math.nan) == "—"
    assert fmt_eta(0.0, 0.0) == "0.00 s"  # the step is closed: nothing to wait for, whatever the rate
    assert [fmt_eta(s, 40.1) for s in (4.0, 200, 7_500, 2 * 86_400 + 3 * 3600)] == [
        "4.00 s", "3m 20s", "2h 05m", "2d 03h",
    ]  # fmt: skip

    line = plain_line(progress(4 / dust, dust))
    assert "eta" not in line and "140737" not in line, line
    assert plain_line(progress(4.0, 40.1)).endswith(", eta 4.00 s")
    assert has(record(render(fold([progress(4 / dust, dust)]))), "next step in —")
    assert has(record(render(fold([progress(200.0, 40.1)]))), "next step in 3m 20s")
    sync = ev.StateSyncProgress(
        t=T0, done_bytes=10, total_bytes=8_000_000, rate=dust, donors_active=1, eta_s=8e6 / dust
    )
    assert "eta" not in plain_line(sync)
    from crowdtrain.commands.status import format_status
    from crowdtrain.protocol.messages import RunStatus

    def status_eta(eta_s: float | None, samples_per_s: float) -> str:
        status = RunStatus(
            run_id="r-1", name="demo", global_step=3, samples=4, target=128, peers_online=2,
            samples_per_s=samples_per_s, eta_s=eta_s, peers=[], recent_steps=[],
        )  # fmt: skip
        return next(line for line in format_status(status).splitlines() if line.startswith("  eta "))

    assert status_eta(4 / dust, dust) == status_eta(None, 0.0) == "  eta           —"
    assert status_eta(200.0, 40.1) == "  eta           3m 20s"


def test_compute_share_in_the_live_view():
    assert fold([]).training.compute_share is None
    assert has(record(render(fold([step_done(None)]))), "compute —")
    state = fold([local_training(0.5, T0), step_done(0.87, T0 + 1)])
    assert state.training.compute_share == 0.87
    assert has(record(render(state)), "compute 87%")
    later = fold([local_training(None, T0 + 2), step_done(None, T0 + 3)], state)
    assert later.training.compute_share == 0.87  # an event that does not know it keeps the last figure
    assert fold([local_training(0.61, T0 + 4)], later).training.compute_share == 0.61


def test_status_shows_each_peers_compute_share():
    from crowdtrain.commands.status import format_status
    from crowdtrain.protocol.messages import PeerStatus, RunStatus, decode, encode

    def peer(peer_id: str, share: float | None) -> PeerStatus:
        return PeerStatus(
            peer_id=peer_id,
            step=18,
            samples=96,
            samples_per_s=62.7,
            client_mode=False,
            chunks_held=121,
            address="127.0.0.1:4000",
            reachable=True,
            compute_share=share,
        )

    status = RunStatus(
        run_id="r-1",
        name="demo",
        global_step=18,
        samples=160,
        target=128,
        peers_online=2,
        samples_per_s=101.6,
        eta_s=0.0,
        peers=[peer("p-alice", 0.87), peer("p-bob", None)],
        recent_steps=[],
    )
    lines = format_status(status).splitlines()
    header = next(line for line in lines if "peer " in line and "compute" in line)
    alice = next(line for line in lines if "p-alice" in line)
    bob = next(line for line in lines if "p-bob" in line)
    assert header.split() == [
        "peer",
        "step",
        "samples",
        "rate",
        "compute",
        "upload",
        "chunks",
        "bittorrent",
        "averaging",
    ]
    assert alice.split()[4] == "87%" and bob.split()[4] == "—"
    assert alice.split()[5] == "—"  # no upload rate measured yet
    # the column lines up under its heading
    end = header.index("compute") + len("compute")
    assert alice[:end].endswith("87%") and bob[:end].endswith("—")
    back = decode(encode(status), RunStatus)  # what `status --json` prints
    assert [p.compute_share for p in back.peers] == [0.87, None]


def test_status_shows_the_runs_way_to_its_schedules_end():
    """``status`` (and the page, from the same RunStatus) says where the run stands on its schedule and when it
    reaches its end at the recent steps' pace: the ETA shown before was the current step's alone."""
    from crowdtrain.commands.status import format_status
    from crowdtrain.protocol.messages import CreditRecord, RunStatus, StepRecord, run_eta

    def record(step: int, closed_at: float) -> StepRecord:
        return StepRecord(
            step=step, closed_at=closed_at, duration_s=1.0, samples=64, peers=2, groups=1, seed=0
        )

    recent = [record(s, 1000.0 + 40.0 * s) for s in (37, 38, 39)]  # a round every 40 s
    assert run_eta(40, 100, recent) == 60 * 40.0
    assert run_eta(100, 100, recent) == 0.0 and run_eta(40, 100, recent[:1]) is None
    status = RunStatus(
        run_id="r-1",
        name="demo",
        global_step=40,
        samples=10,
        target=64,
        peers_online=2,
        samples_per_s=1.6,
        eta_s=30.0,
        peers=[],
        recent_steps=recent,
        total_steps=100,
        run_eta_s=run_eta(40, 100, recent),
    )
    assert status.progress == 0.4
    line = next(line for line in format_status(status).splitlines() if line.startswith("  run "))
    assert line.split(None, 1)[1] == "40 / 100 steps (40%), eta 40m 00s", line
    done = format_status(msgspec_replace(status, global_step=100, run_eta_s=0.0))
    assert "100 / 100 steps (100%), reached" in done
    # the credit ledger's spot-check columns only where the run draws checks
    credit = CreditRecord(public_key="ab" * 32, samples=640, steps=10, last_step=39, verified=3, rejected=0)
    local = format_status(msgspec_replace(status, credits=[credit], spot_checked=False))
    checked = format_status(msgspec_replace(status, credits=[credit], spot_checked=True))
    assert "verified" not in local and "spot-checks" not in local and "640" in local, local
    assert "verified" in checked and "rejected" in checked, checked


def test_loss_history_and_log_tail_are_bounded():
    from crowdtrain.volunteer.view.state import LOG_LINES, LOSS_POINTS

    events = [
        ev.LocalTraining(t=T0 + i, loss=10.0 - i * 0.01, samples=i, samples_per_s=1.0, micro_batches=i)
        for i in range(LOSS_POINTS + 25)
    ] + [ev.LogLine(t=T0 + 100 + i, level="info", message=f"line {i}") for i in range(LOG_LINES + 4)]
    state = fold(events)
    assert len(state.training.loss_history) == LOSS_POINTS
    assert state.training.loss_history[-1] == pytest.approx(10.0 - (LOSS_POINTS + 24) * 0.01)
    assert [e.message for e in state.log] == [f"line {i}" for i in range(4, LOG_LINES + 4)]


def test_unknown_event_types_only_move_the_clock():
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class PeerWaved(ev.Event):
        who: str

    state = fold(script()[:3])
    after = apply(state, PeerWaved(t=T0 + 500, who="p-zed"))
    assert after == dataclasses.replace(state, last_t=T0 + 500)
    assert plain_line(PeerWaved(t=T0, who="p-zed")) == f"{stamp(T0)} PeerWaved who=p-zed"


def test_sparkline_and_bar():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([3.0, 3.0, 3.0]) == "▄▄▄"
    assert sparkline([1.0, math.nan, 2.0]) == "▁ █"
    assert sparkline([]) == ""
    assert sparkline(list(range(100)), width=5) == "▁▃▅▆█"
    assert bar(0.5, 10).plain == "█████░░░░░"
    assert bar(0.25, 10).plain == "██▌░░░░░░░"
    assert bar(None, 4).plain == "░░░░"
    assert bar(7.0, 4).plain == "████"


def test_formats():
    assert [fmt_bytes(n) for n in (0, 999, 1000, 1_234_000, 34_500, 345_000, 999_600, 5e15)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "1.2 MB",
        "34.5 kB",
        "345 kB",
        "1.0 MB",
        "5.0 PB",
    ]
    assert fmt_rate(1_234_000) == "1.2 MB/s"
    assert fmt_rate(None) == "—"
    assert [fmt_duration(s) for s in (0.25, 12.5, 185, 3725, None)] == [
        "0.25 s",
        "12.5 s",
        "3m 05s",
        "1h 02m",
        "—",
    ]
    assert fmt_duration(2 * 86_400 + 3 * 3600 + 59) == "2d 03h"
    assert fmt_uptime(59.9) == "59s"
    assert fmt_ratio(7.5) == "7.5×"
    assert fmt_ratio(0.0) == "—"


# ------------------------------------------------------------ --plain and --json lines


def expected_plain() -> list[str]:
    texts = [
        (
            0,
            "joined run tiny-shakespeare (r-7f3a) at http://127.0.0.1:8471 as p-carol on cpu, peer server at "
            "127.0.0.1:40123; global step 40, target 256 samples, recipe tiny-gpt, codec int8",
        ),
        (1, "phase: catching-up"),
        (1, "state sync: fetching step 40 (ab12cd34ef56), 8.0 MB from 2 donors"),
        (2, "state sync: 2.0 MB/8.0 MB (25%) at 1.0 MB/s, 2 donors, eta 6.00 s"),
        (3, "WARNING state sync: donor p-bob banned: part 3 failed its hash check"),
        (8, "state loaded: step 40 (ab12cd34ef56) in 7.00 s from p-alice"),
        (9, "chunk 11 verified (chunk-00011, 512 samples): 12/40 held"),
        (10, "data: 12/40 chunks (30%), down 1.2 MB/s, up 345 kB/s, 3 peers (1 seeding), ratio 0.25"),
        (10, "phase: training"),
        (11, "loss 4.2500, 32 samples toward this step, 12.5 samples/s, 4 micro-batches, compute —"),
        (12, "loss 3.9876, 64 samples toward this step, 12.8 samples/s, 8 micro-batches, compute 80%"),
        (13, "collaboration at step 41: 96/256 samples, 3 peers online, 40.1 samples/s, eta 4.00 s"),
        (14, "phase: averaging"),
        (
            15,
            "WARNING grad round rd-41 for step 41: 3 members, 1.50 s, sent 400 kB, received 410 kB, "
            "7.5× compression; dropped p-bob; clipped p-alice; failed parts 1",
        ),
        (
            16,
            "step 41 done: 96/256 samples from this machine (38%), loss 2.314, lr 0.0003, 6.40 s, compute 87%",
        ),
        (
            30,
            "WARNING missed step 42 (collaboration at 44); 48 samples dropped (computed on that step's parameters); fetching the state",
        ),
        (31, "WARNING round rd-44 for step 44 failed: group had 1 member"),
        (
            31,
            "WARNING step 45: part 2's answer from owner p-evil refused (the answer is not the mean of the copies "
            "listed); the tracker: barred",
        ),
        (
            31,
            "WARNING step 46: member p-pull's copy points against the others' (cosine -0.84); the tracker: counted",
        ),
        (32, "WARNING tracker answered slowly (2.1 s)"),
        (33, "serving state of step 41 (99aa88bb77cc, 8.0 MB)"),
        (33, "held-out evaluation of step 40: loss 2.5012, accuracy 0.4375"),
        (
            33,
            "reachable for averaging at 127.0.0.1:40123; BitTorrent port 6881 is not reachable at "
            "127.0.0.1:6881 (chunks still arrive over outgoing connections; to serve them to others, forward "
            "TCP 6881 and pass --bt-port 6881)",
        ),
        (33, "the router forwards TCP 40123 to this machine's peer server (UPnP)"),
        (33, "WARNING the tracker found a problem with this run"),
        (65, "left the run: interrupted"),
    ]
    return [f"{stamp(T0 + dt)} {text}" for dt, text in texts]


def test_plain_lines_line_by_line():
    got = [plain_line(e) for e in script()]
    assert got == expected_plain()


def test_json_lines_line_by_line():
    events = script()
    lines = [json_line(e) for e in events]
    assert lines[1] == f'{{"event":"PhaseChanged","t":{T0 + 1},"phase":"catching-up"}}'
    assert lines[4] == (
        f'{{"event":"DonorBanned","t":{T0 + 3},"donor":"p-bob","reason":"part 3 failed its hash check"}}'
    )
    for event, line in zip(events, lines, strict=True):
        assert "\n" not in line
        data = json.loads(line)
        assert data == json.loads(json.dumps(ev.to_dict(event)))
        assert data["event"] == type(event).__name__
        assert parse_json_line(line) == event
    step_done = json.loads(lines[14])
    assert (step_done["compute_share"], step_done["compute_s"], step_done["delayed"]) == (0.87, 5.5, False)
    assert json.loads(lines[9])["compute_share"] is None and json.loads(lines[10])["compute_share"] == 0.8
    round_done = json.loads(lines[13])
    assert round_done["members"] == ["p-alice", "p-bob", "p-carol"]
    assert round_done["phases"] == {"encode": 0.1, "exchange": 1.3, "decode": 0.1}


def test_json_line_turns_nan_into_null_and_back():
    event = ev.LocalTraining(t=T0, loss=math.nan, samples=1, samples_per_s=math.inf, micro_batches=1)
    line = json_line(event)
    assert json.loads(line)["loss"] is None and json.loads(line)["samples_per_s"] is None
    back = parse_json_line(line)
    assert math.isnan(back.loss) and math.isnan(back.samples_per_s)
    assert (
        plain_line(event)
        == f"{stamp(T0)} loss nan, 1 samples toward this step, —, 1 micro-batches, compute —"
    )


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("not json", "is not JSON"),
        ("[1, 2]", 'with an "event" name'),
        ('{"event": "Exploded", "t": 1}', "unknown event 'Exploded'"),
        ('{"event": "PhaseChanged", "t": 1}', "wrong fields"),
        ("{" + " " * (1 << 20) + "}", "longer than"),
    ],
)
def test_parse_json_line_rejects_bad_lines(line, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        parse_json_line(line)


def test_line_throttle_thins_only_chatty_events():
    throttle = LineThrottle(5.0)
    stats = [dataclasses.replace(script()[7], t=T0 + dt) for dt in (0, 1, 4.9, 5, 9, 10.5)]
    assert [throttle.admit(e) for e in stats] == [True, False, False, True, False, True]
    phases = [ev.PhaseChanged(t=T0 + i * 0.01, phase="training") for i in range(5)]
    assert all(throttle.admit(e) for e in phases)
    assert all(LineThrottle(0).admit(e) for e in stats)


# ------------------------------------------------------------ ViewSink


async def run_sink(sink: ViewSink, events: list[ev.Event]) -> None:
    task = asyncio.create_task(sink.run())
    for event in events:
        sink.emit(event)
        await asyncio.sleep(0)
    await sink.close()
    await task


async def test_sink_plain_mode_writes_the_lines_with_chatty_ones_thinned():
    out = io.StringIO()
    sink = ViewSink("plain", out, plain_interval_s=5.0)
    await run_sink(sink, script())
    expected = expected_plain()
    # The second local-training summary came 1 s after the first: thinned. Nothing else is chatty-close.
    del expected[10]
    assert out.getvalue().splitlines() == expected
    assert sink.events_applied == len(script()) and sink.lines_written == len(expected)


async def test_sink_plain_mode_without_thinning_writes_every_line():
    out = io.StringIO()
    await run_sink(ViewSink("plain", out, plain_interval_s=0), script())
    assert out.getvalue().splitlines() == expected_plain()


async def test_sink_json_mode_writes_every_event():
    out = io.StringIO()
    sink = ViewSink("json", Console(file=out))
    await run_sink(sink, script())
    assert out.getvalue().splitlines() == [json_line(e) for e in script()]


async def test_sink_flushes_events_emitted_before_run_and_drops_after_close():
    out = io.StringIO()
    sink = ViewSink("plain", out, plain_interval_s=0)
    for event in script()[:3]:
        sink.emit(event)
    await sink.close()  # run() never started: close flushes
    assert out.getvalue().splitlines() == expected_plain()[:3]
    sink.emit(script()[3])
    await sink.close()
    await sink.run()  # returns at once: the sink is closed
    assert out.getvalue().splitlines() == expected_plain()[:3]


async def test_sink_accepts_events_from_other_threads():
    out = io.StringIO()
    sink = ViewSink("json", out)
    task = asyncio.create_task(sink.run())
    await asyncio.sleep(0)
    sent = [ev.LogLine(t=T0 + i, level="info", message=f"from a thread {i}") for i in range(300)]

    def produce() -> None:
        for event in sent:
            sink.emit(event)

    thread = threading.Thread(target=produce)
    thread.start()
    await asyncio.to_thread(thread.join)
    await sink.close()
    await task
    assert out.getvalue().splitlines() == [json_line(e) for e in sent]


async def test_sink_live_mode_ends_with_the_panels_on_a_recording_console():
    console = Console(width=100, color_system=None, record=True, file=io.StringIO())
    sink = ViewSink("live", console)
    await run_sink(sink, script()[:-1])
    text = console.export_text()
    for title in ("collaboration", "local training", "data set", "state sync", "averaging", "recent"):
        assert f"─ {title} ─" in text
    for figure in ("global step 44", "12/40", "1.2 MB/s", "7.5×", "3.9876", "lag 2 steps behind", "p-carol"):
        assert has(text, figure), figure
    assert sink.state == fold(script()[:-1])
    assert sink.renders >= 2  # the first frame and the last


async def test_sink_live_mode_routes_logging_above_the_view():
    out = io.StringIO()
    console = Console(width=100, color_system=None, force_terminal=True, record=True, file=out)
    sink = ViewSink("live", console)
    root = logging.getLogger()
    before = list(root.handlers)
    task = asyncio.create_task(sink.run())
    for event in script()[:3]:
        sink.emit(event)
    await asyncio.sleep(0.05)
    logging.getLogger("crowdtrain.test_view").warning("disk is slow: %d ms", 250)
    await sink.close()
    await task
    text = console.export_text()
    assert "disk is slow: 250 ms" in text
    assert text.index("disk is slow") < text.rindex("─ averaging ─")  # printed above the last frame
    assert root.handlers == before


async def test_sink_live_refresh_rate_is_bounded():
    """Many events emitted quickly: each render folds many of them, and renders are at most rate × elapsed + 1."""
    console = Console(width=100, color_system=None, force_terminal=True, file=io.StringIO())
    hz = 20.0
    sink = ViewSink("live", console, max_refresh_hz=hz)
    started = time.monotonic()
    task = asyncio.create_task(sink.run())
    events = [
        ev.LocalTraining(
            t=T0 + i * 0.001, loss=5.0 - i * 0.001, samples=i, samples_per_s=100.0, micro_batches=i
        )
        for i in range(3000)
    ]
    for i, event in enumerate(events):
        sink.emit(event)
        if i % 100 == 99:
            await asyncio.sleep(0.005)
    await sink.close()
    await task
    elapsed = time.monotonic() - started
    assert sink.events_applied == len(events)
    assert sink.state.training.micro_batches == 2999
    assert 2 <= sink.renders <= len(events)
    assert sink.renders <= hz * elapsed + 1, (sink.renders, elapsed)


def test_choose_mode():
    import os

    assert choose_mode("live", io.StringIO()) == "plain"
    assert choose_mode("json", io.StringIO()) == "json"
    assert choose_mode("plain", io.StringIO()) == "plain"
    assert choose_mode("live", Console(file=io.StringIO(), force_terminal=True)) == "live"
    assert choose_mode("live", Console(file=io.StringIO())) == "plain"
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            assert choose_mode("live", tty) == "live"
    finally:
        os.close(leader)
        os.close(follower)
    with pytest.raises(ConfigError, match="mode"):
        choose_mode("fancy", io.StringIO())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_refresh_hz": 0}, "max_refresh_hz"),
        ({"idle_refresh_s": -1}, "idle_refresh_s"),
        ({"plain_interval_s": -1}, "plain_interval_s"),
    ],
)
def test_sink_settings_are_checked(kwargs, field):
    with pytest.raises(ConfigError) as caught:
        ViewSink("live", io.StringIO(), **kwargs)
    assert caught.value.field == field


# ------------------------------------------------------------ the demo's combined view


def test_render_demo_rows():
    alice = fold(script()[:-1])
    carol = fold(script()[:4])  # still catching up
    collab = fold([script()[0], script()[11]])
    rows = [DemoRow.from_state("alice", alice), DemoRow.from_state("carol", carol), DemoRow(name="dave")]
    assert rows[0].lag == 2 and rows[1].sync_fraction == 0.25
    text = record(render_demo(collab, rows))
    assert "─ collaboration · tiny-shakespeare ─" in text
    assert has(text, "global step 41")
    assert "96/256" in text
    alice_line = next(line for line in text.splitlines() if "alice" in line)
    for figure in ("averaging", "42 −2", "12/40", "12.8/s", "3.9876", "41 · 1.50 s · 7.5×"):
        assert figure in alice_line, figure
    carol_line = next(line for line in text.splitlines() if "carol" in line)
    assert "catching-up 25%" in carol_line
    dave_line = next(line for line in text.splitlines() if "dave" in line)
    assert "starting" in dave_line


def test_view_imports_no_engine_and_events_import_no_rich():
    import subprocess
    import sys

    code = (
        "import sys, crowdtrain.volunteer.view.live, crowdtrain.volunteer.view.demo;"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    mods = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    )
    volunteer = {m for m in mods if m.startswith("crowdtrain.volunteer")}
    assert all(
        m in ("crowdtrain.volunteer", "crowdtrain.volunteer.events")
        or m.startswith("crowdtrain.volunteer.view")
        for m in volunteer
    ), volunteer
    assert "torch" not in mods and "libtorrent" not in mods
    code = "import sys, crowdtrain.volunteer.events; print('\\n'.join(sorted(sys.modules)))"
    mods = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    )
    assert "rich" not in mods


# Run with the repository root as its working directory, where ``python -c`` finds ``tests`` as the suite does.
PTY_SCRIPT = """
import asyncio, sys
from tests.test_view import script
from crowdtrain.volunteer.view.live import ViewSink, choose_mode

async def main():
    mode = choose_mode("live", sys.stdout)
    print("mode", mode, flush=True)
    sink = ViewSink(mode, max_refresh_hz=10)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(sink.run())
        for event in script()[:-1]:
            sink.emit(event)
            await asyncio.sleep(0.02)
        await sink.close()

asyncio.run(main())
"""


def test_live_view_in_a_real_terminal():
    """Under a pseudo-terminal the sink picks live mode and redraws the panels in place."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    leader, follower = os.openpty()
    env = dict(os.environ, COLUMNS="100", LINES="60", TERM="xterm-256color")
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", PTY_SCRIPT],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env=env,
            cwd=root,
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(leader)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert "mode live" in screen
    assert "\x1b[" in screen  # cursor movement: frames redrawn in place
    for figure in ("collaboration", "local training", "data set", "state sync", "averaging", "12/40", "7.5×"):
        assert figure in screen, figure


async def test_a_malformed_event_does_not_stop_the_sink(caplog):
    """An engine bug (a field of the wrong type) is logged; live mode falls back to plain lines, run() goes on."""
    broken = ev.Progress(
        t=T0 + 1, global_step=3, samples="many", target=256, peers_online=1, samples_per_s=1.0, eta_s=None,
        reachable=True,
    )  # fmt: skip
    after = ev.PhaseChanged(t=T0 + 2, phase="training")

    out = io.StringIO()
    sink = ViewSink("live", Console(file=out, width=100, color_system=None))
    with caplog.at_level(logging.ERROR, logger="crowdtrain.volunteer.view.live"):
        sink.emit(script()[0])
        sink.emit(broken)
        task = asyncio.create_task(sink.run())
        await asyncio.sleep(0)  # run() draws its first frame, fails, and switches before it first waits
        assert sink.showing == "plain"
        sink.emit(after)
        await sink.close()
        await task
    assert sink.showing == "plain"
    assert "the live view could not draw the latest events" in caplog.text
    assert "printing plain lines from here on" in caplog.text
    assert out.getvalue().splitlines()[-1] == f"{stamp(T0 + 2)} phase: training"

    caplog.clear()
    out = io.StringIO()
    with caplog.at_level(logging.ERROR, logger="crowdtrain.volunteer.view.live"):
        await run_sink(
            ViewSink("json", out), [script()[0], ev.LogLine(t=T0, level="info", message=object()), after]
        )
    assert "could not print a LogLine event; skipped it" in caplog.text
    assert out.getvalue().splitlines() == [json_line(script()[0]), json_line(after)]


def test_render_client_mode_and_a_clean_round():
    state = fold(script()[:-1])
    clean = dataclasses.replace(
        state.averaging.last_round, my_part=-1, dropped=(), clipped=(), failed_parts=(), phases={}
    )
    state = dataclasses.replace(
        state,
        averaging=dataclasses.replace(state.averaging, last_round=clean),
        header=dataclasses.replace(state.header, address=None),
    )
    text = record(render(state))
    assert has(text, "mode client (sends only)")
    assert has(text, "members p-alice, p-bob, p-carol (client mode: sent only)")
    assert has(text, "trouble none")
    assert "timing" not in text


def test_local_steps_mode_is_named_on_joining_and_the_round_counts_its_inner_steps():
    joined = dataclasses.replace(script()[0], inner_steps=30)
    assert plain_line(joined).endswith("codec int8; local steps: an outer round of 30 inner steps' samples")
    assert "local steps" not in plain_line(script()[0])  # every-step mode: not a word of it
    rounds = [
        joined,
        ev.LocalTraining(
            t=T0 + 1, loss=3.5, samples=192, samples_per_s=40.0, micro_batches=12, inner_steps=3
        ),
    ]
    text = record(render(fold(rounds)))
    assert has(text, "this round 192 samples, 3 inner steps"), text
    assert "this step" not in text
    # every-step mode keeps its row
    text = record(render(fold([script()[0], local_training(0.5)])))
    assert has(text, "this step 8 samples") and "this round" not in text
    for event in rounds:
        assert parse_json_line(json_line(event)) == event


def test_a_local_steps_round_reads_truthfully_in_the_view_and_the_plain_lines():
    """Local-steps mode: the inner and the outer learning rate, the round's wall time and its averaging named
    apart (the view said "step time 0.23 s" of rounds of about 40 s), the round's samples and inner steps; every
    value in the live view and in the plain lines."""
    joined = dataclasses.replace(script()[0], inner_steps=10, total_steps=1000)
    inner = ev.LocalTraining(
        t=T0 + 5,
        loss=3.1,
        samples=304,
        samples_per_s=40.0,
        micro_batches=19,
        inner_steps=11,
        inner_lr=0.003,
        compute_share=0.91,
    )
    first = ev.StepDone(
        t=T0 + 41,
        step=0,
        lr=0.7,
        contributed_samples=400,
        group_samples=1280,
        step_time_s=0.4,
        loss=3.0,
        compute_share=0.93,
        local=True,
        wall_s=None,
    )
    second = dataclasses.replace(first, t=T0 + 81, step=1, step_time_s=0.6, wall_s=40.0)
    progress = ev.Progress(
        t=T0 + 6,
        global_step=40,
        samples=1216,
        target=2560,
        peers_online=4,
        samples_per_s=160.0,
        eta_s=8.4,
        reachable=True,
    )
    text = record(render(fold([joined, inner, progress])))
    assert has(text, "this round 304 samples, 11 inner steps"), text
    assert has(text, "my share 25% (this round so far)"), text  # (it said 0 % after 304 samples)
    assert has(text, "compute 91%"), text  # (the round under way counts: it showed 0 % until it ended)
    assert has(text, "lr inner 0.003 · outer —"), text
    text = record(render(fold([joined, inner, first, second])))
    assert has(text, "lr inner 0.003 · outer 0.7"), text
    assert has(text, "round time 40.0 s") and has(text, "averaging 0.50 s"), text
    assert "step time" not in text and has(text, "next round in"), text
    assert has(text, "this round 0 samples, 0 inner steps"), text  # (a new round: it said 11 inner steps)
    # the run's way to its schedule's end, at the rounds' wall time: 960 rounds of 40 s from step 40
    assert has(text, "run 40/1000 steps, eta 10h 40m"), text
    done = record(render(fold([dataclasses.replace(joined, total_steps=40), inner, first, second])))
    assert has(done, "run 40/40 steps, reached"), done
    assert "loss 3.1000, 304 samples and 11 inner steps this round, inner lr 0.003" in plain_line(inner)
    line = plain_line(second)
    assert "round 1 done: 400/1280 samples from this machine (31%)" in line, line
    assert "outer lr 0.7, round 40.0 s, averaging 0.60 s, compute 93%" in line, line
    # every-step mode keeps its words
    text = record(render(fold([script()[0], dataclasses.replace(first, local=False)])))
    assert has(text, "step time") and "round time" not in text and "inner" not in text, text
    assert " step 0 done: " in plain_line(dataclasses.replace(first, local=False))
    for event in (inner, second):
        assert parse_json_line(json_line(event)) == event


def test_port_mapping_answers_read_as_sentences():
    granted = ev.PortMapped(t=T0, what="peer server", port=41234, via="UPnP", external_port=41234)
    moved = ev.PortMapped(t=T0, what="BitTorrent", port=6881, via="NAT-PMP", external_port=50000)
    refused = ev.PortMapped(
        t=T0, what="peer server", port=41234, via="UPnP", external_port=None, error="Action Failed"
    )
    assert plain_line(granted).endswith("the router forwards TCP 41234 to this machine's peer server (UPnP)")
    assert plain_line(moved).endswith(
        "the router forwards TCP 6881 (as 50000 outside) to this machine's BitTorrent (NAT-PMP)"
    )
    assert plain_line(refused).endswith(
        "the router did not forward TCP 41234 (peer server) over UPnP: Action Failed"
    )
    assert parse_json_line(json_line(refused)) == refused
