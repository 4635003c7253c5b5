"""The tracker's web pages, read by a real headless Chromium (issue 17): a live run's page shows its step,
peers and loss curve and follows the run; strings a peer or publisher chose stay text; a private run's
page needs its token."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from crowdtrain.protocol.client import TrackerClient
from crowdtrain.tracker.config import TrackerConfig
from crowdtrain.tracker.server import serve
from tests.harness import published_run, until, volunteers
from tests.sim import SimVolunteer, make_run_create

INSTALL = "apt-get install -y --no-install-recommends chromium (`make test` does it when run as root)"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"no headless Chromium on this machine; install it: {INSTALL}")


async def browse(url: str, profile: Path, *flags: str, budget_ms: int = 5000) -> str:
    """What Chromium shows at ``url`` once its scripts ran for ``budget_ms`` of virtual time."""
    await asyncio.to_thread(profile.mkdir, parents=True, exist_ok=True)
    args = [
        chromium(),
        "--headless",
        "--no-sandbox",  # (as root in CI)
        "--disable-gpu",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *flags,
        url,
    ]
    out = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def field(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"no element {element_id!r} in the page:\n{dom[:3000]}"
    return match[1]


def points(dom: str, element_id: str) -> int:
    match = re.search(rf'id="{element_id}"[^>]*data-points="(\d+)"', dom) or re.search(
        rf'data-points="(\d+)"[^>]*id="{element_id}"', dom
    )
    assert match, f"no curve {element_id!r} in the page:\n{dom[:3000]}"
    return int(match[1])


def peer_rows(dom: str) -> int:
    body = re.search(r'<table id="peers">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert body, dom[:3000]
    return body[1].count("<tr>")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_live_runs_page_shows_its_step_peers_and_loss_curve_as_steps_close(tmp_path):
    async with published_run(tmp_path, target_batch_size=32) as run:
        run_id, url = run.spec.run_id, f"{run.tracker.url}/runs/{run.spec.run_id}"
        vols = volunteers(run, tmp_path, 3)
        tasks = [asyncio.create_task(v.run()) for v in vols]
        try:
            async with TrackerClient(run.tracker.url) as client:

                async def global_step() -> int:
                    return (await client.status(run_id)).global_step

                step = 0

                async def reached(n: int) -> bool:
                    nonlocal step
                    step = await global_step()
                    return step >= n and (await client.status(run_id)).peers_online == 3

                await until(
                    lambda: reached(3), 120, "step 3 with three peers online", every_s=0.2, watching=tasks
                )
                first = await browse(url, tmp_path / "profile", "--dump-dom")
                shown = int(field(first, "step"))
                assert shown >= step >= 3
                assert peer_rows(first) == 3
                # the credit ledger: one row per volunteer key whose samples entered the averages
                ledger = re.search(r"<table id=\"?credits\"?.*?<tbody>(.*?)</tbody>", first, re.S)
                assert ledger and ledger.group(1).count("<tr>") == 3, ledger
                # the seeder and the volunteers announce the data set to this tracker
                assert re.fullmatch(r"\d+ peers, [1-9]\d* seeds", field(first, "swarm")), field(
                    first, "swarm"
                )
                # one point a closed step (each has its peers' loss), at least as many as had closed
                assert points(first, "loss-line") >= step, field(first, "loss-label")
                assert "every step · codec none" in first and field(first, "group-size") == "4"
                await until(
                    lambda: min(v.step for v in vols) >= shown + 3, 120, "three more steps", watching=tasks
                )
                second = await browse(url, tmp_path / "profile", "--dump-dom")
                assert int(field(second, "step")) > shown
                assert points(second, "loss-line") > points(first, "loss-line")
                # the chart's label: the steps it spans, the lowest, highest and last loss of its points
                label = re.fullmatch(
                    r"steps (\d+)–(\d+) · min (\S+) · max (\S+) · last (\S+)", field(second, "loss-label")
                )
                assert label, field(second, "loss-label")
                first_step, last_step = map(int, label.groups()[:2])
                lo, hi, last = map(float, label.groups()[2:])
                assert (
                    first_step < last_step <= int(field(second, "step")) and lo <= last <= hi and lo < hi
                ), label[0]
                # the run's way to its schedule's end, with an ETA at the recent pace
                total = run.spec.schedule.total_steps
                progress = re.fullmatch(rf"(\d+) / {total} steps, eta (.+)", field(second, "run-progress"))
                assert progress and progress[2] != "–", field(second, "run-progress")
                # every-step mode with spot-checks: their columns are shown
                assert 'class="checks">spot-checks passed' in second and 'class="checks" hidden' not in second
                # a fixed mode: no column of each round's inner steps
                assert '<th class="inner" hidden="">' in second, second[:3000]
                shot = tmp_path / "run-page.png"
                await browse(url, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,1000")
                image = shot.read_bytes()
                assert image.startswith(b"\x89PNG")
                # an empty white page compresses to a few kB; this one has text, a chart and tables
                assert len(image) > 30_000, len(image)
                if os.environ.get("CROWDTRAIN_SCREENSHOT_TO"):  # how docs/images/run-page.png was made
                    shutil.copy(shot, os.environ["CROWDTRAIN_SCREENSHOT_TO"])
        finally:
            for v in vols:
                v.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_local_steps_runs_page_shows_each_rounds_h_and_hides_the_spot_check_columns(tmp_path):
    """``inner_steps = "auto"``: the page says H is the tracker's, lists each round's, and hides the spot-check
    columns (no spot-check runs in local steps)."""
    averaging = {
        "inner_steps": "auto",
        "inner_steps_min": 2,
        "inner_steps_max": 8,
        "delay": 1,
        "codec": "int2",
    }
    async with published_run(tmp_path, target_batch_size=16, averaging=averaging) as run:
        url = f"{run.tracker.url}/runs/{run.spec.run_id}"
        vols = volunteers(run, tmp_path, 3, max_steps=6)
        await asyncio.wait_for(asyncio.gather(*(v.run() for v in vols)), 200)
        async with TrackerClient(run.tracker.url) as client:
            status = await client.status(run.spec.run_id)
        page = await browse(url, tmp_path / "profile", "--dump-dom")
    assert "outer round of H × the target batch, H chosen by the tracker each round (2–8)" in page, page[
        :3000
    ]
    assert '<th class="checks" hidden="">' in page and '<th class="inner">inner steps</th>' in page
    body = re.search(r'<table id="steps">.*?<tbody>(.*?)</tbody>', page, re.S)
    assert body, page[:3000]
    shown = [int(cells[5]) for cells in re.findall(r"<tr>" + "<td>([^<]*)</td>" * 7 + "</tr>", body[1])]
    recorded = [r.inner_steps for r in sorted(status.recent_steps, key=lambda r: -r.step)]
    assert shown and shown == recorded[: len(shown)], (shown, recorded)


HOSTILE = "<img src=x onerror=\"document.title='pwned'\">&amp;</td><script>document.title='pwned'</script>"


@pytest.mark.timeout(180)
async def test_hostile_strings_stay_text_and_a_private_runs_page_needs_its_token(tmp_path):
    async with serve(TrackerConfig()) as tracker:
        async with TrackerClient(tracker.url, admin_token=tracker.admin_token) as client:
            public = (await client.create_run(make_run_create(HOSTILE))).run_id
            private = (
                await client.create_run(make_run_create("secret run", join_token="s3cret-token"))
            ).run_id
            peer = SimVolunteer(client, public)
            await peer.join()
            await peer.heartbeat(0, 3)
        # the index lists the public run, as text, and not the private one
        index = await browse(f"{tracker.url}/", tmp_path / "profile", "--dump-dom", budget_ms=1000)
        assert "<title>crowdtrain tracker</title>" in index
        assert "&lt;img src=x" in index and "&lt;script&gt;" in index and "<img" not in index
        assert "secret run" not in index and private not in index
        page = await browse(f"{tracker.url}/runs/{public}", tmp_path / "profile", "--dump-dom")
        # the scripts in the name never ran: the title is the name, as text, not 'pwned'
        assert re.search(r"<title>(.*?)</title>", page, re.S)[1].startswith("&lt;img src=x onerror=")
        assert "<img" not in page and field(page, "name").startswith("&lt;img src=x")
        assert peer_rows(page) == 1 and peer.peer_id in page
        async with aiohttp.ClientSession() as http:
            # (the admin token opens it from the Authorization header only: a URL is logged everywhere)
            queries = [("", 403), ("?token=wrong", 403), (f"?admin_token={tracker.admin_token}", 403)]
            for query, status in [*queries, ("?token=s3cret-token", 200)]:
                async with http.get(f"{tracker.url}/runs/{private}{query}") as resp:
                    body = await resp.text()
                    assert resp.status == status, body
                    if status == 403:
                        assert f"run {private} is private" in body
                    else:
                        assert "s3cret-token" not in body and tracker.admin_token not in body
            auth = {"Authorization": f"Bearer {tracker.admin_token}"}
            async with http.get(f"{tracker.url}/runs/{private}", headers=auth) as resp:
                assert resp.status == 200 and tracker.admin_token not in await resp.text()
        refused = await browse(
            f"{tracker.url}/runs/{private}", tmp_path / "profile", "--dump-dom", budget_ms=500
        )
        assert "is private" in refused and 'id="step"' not in refused
