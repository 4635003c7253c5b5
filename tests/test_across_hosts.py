"""A run across hosts: tracker, seeder and volunteers each on a host of their own (a network namespace on a
bridge, see tests/netns.py), every one started with the README's own commands and no address flag.

(a) four volunteers, the last one late: every volunteer takes the steps, chunks pass between volunteers,
    the late one loads the state from a donor on another host;
(b) the same with every volunteer but one at home behind a NAT router (nft masquerade, nothing gets in): the
    tracker finds it cannot reach them and says so, and they train as senders through the one reachable one;
(c) every volunteer in ``--client-mode``: no round is formed or fails, nobody's parameters are reset, the
    run's step stays at 0, and the volunteers and ``crowdtrain status`` say why in one sentence.

Each host has its own HOME (its own data folder), as separate machines would. A CLI's ``--json`` lines are
read by a thread per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.netns import Host, Network, requires_netns

pytestmark = [requires_netns, pytest.mark.slow, pytest.mark.timeout(400)]

PORT = 8470  # the README's port: each host is its own machine, nothing else listens there
LATE_AT = 3  # the late volunteer starts once the run reached this step
LATE_STEPS = 10  # and everyone is stopped once it took this many
RUN_TOML = """\
name = "across hosts"
target_batch_size = 256
micro_batch_size = 8

[model]
recipe = "tiny-gpt"
[model.args]
d_model = 32
n_layer = 1
n_head = 2
seq_len = 32

[dataset]
dir = "data"

[optimizer]
lr = 0.003

[averaging]
group_size = 4                   # codec "int8" (the default; "int2" in local steps)
"""


class Cli:
    """One ``crowdtrain`` process on a host; its stdout lines (and JSON events) collected by a thread."""

    def __init__(self, host: Host, home: Path, *args: str, unset: tuple[str, ...] = ()) -> None:
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_") and k not in unset}
        # PYTHONFAULTHANDLER: a process that does not exit in time is sent SIGABRT and prints every thread's
        # stack, so the failure says where it hung
        env.update(
            HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200", PYTHONFAULTHANDLER="1"
        )
        self.args = args
        self.lines: list[str] = []
        self.events: list[dict] = []
        self.proc = host.popen(
            [sys.executable, "-m", "crowdtrain", *args],
            env=env,
            cwd=home,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e.get("event") == kind]

    def wait_for(self, what: str, predicate: Callable[[], bool], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while not predicate():
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(
                    f"{' '.join(self.args[:2])} exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {within_s} s:\n{self.tail()}")
            time.sleep(0.2)

    def line_matching(self, pattern: str, within_s: float = 60) -> re.Match:
        found: list[re.Match] = []

        def seen() -> bool:
            found[:] = [m for line in list(self.lines) if (m := re.search(pattern, line))]
            return bool(found)

        self.wait_for(f"a line matching {pattern!r}", seen, within_s)
        return found[0]

    def finish(self, within_s: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # its stacks, then it is gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            self._reader.join(5)
            raise AssertionError(
                f"{' '.join(self.args[:2])} did not exit within {within_s} s:\n{self.tail(120)}"
            ) from None
        self._reader.join(10)
        return code

    def interrupt(self, within_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.finish(within_s)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


class Published:
    """Tracker and seeder up, a run created: what the README's publisher walk-through does."""

    def __init__(
        self,
        net: Network,
        tmp: Path,
        *,
        seed_with_token: bool = True,
        averaging: str = "",
        run_toml: str = RUN_TOML,
    ) -> None:
        tracker_host, seeder_host = net.hosts["tracker"], net.hosts["seeder"]
        self.tracker = Cli(
            tracker_host, tmp / "tracker", "tracker", "serve", "--host", "0.0.0.0", "--port", str(PORT)
        )
        self.url = f"http://{tracker_host.ip}:{PORT}"
        # it names a URL others can use, not 0.0.0.0
        self.tracker.line_matching(re.escape(f"others reach it at: {self.url}"))
        self.token = self.tracker.line_matching(r"admin token: (\S+)").group(1)
        self.home = tmp / "seeder"
        self.home.mkdir()
        # the README's run file (or ``run_toml``), with ``averaging`` lines taken in (e.g. its "# delay = 1";
        # the last table is [averaging])
        (self.home / "run.toml").write_text(run_toml + averaging)
        made = Cli(
            seeder_host, self.home, "dataset", "make", "builtin:stdlib", "--out", "data",
            "--tracker", self.url, "--chunk-size", "64KiB", "--max-bytes", "768KiB",
        )  # fmt: skip
        assert made.finish(120) == 0, made.tail()
        seed = ["dataset", "seed", "data", "--tracker", self.url, "--upload-limit", "128KiB", "--json"]
        if seed_with_token:  # as the README shows: the seeder registers the data set
            self.seeder = Cli(seeder_host, self.home, *seed, "--admin-token", self.token)
            self.seeder.wait_for("seeding", lambda: self.seeder.of("Seeding"), 60)
        created = Cli(
            seeder_host,
            self.home,
            "run",
            "create",
            "run.toml",
            "--tracker",
            self.url,
            "--admin-token",
            self.token,
        )
        assert created.finish(60) == 0, created.tail()
        self.run_id = created.lines[-1].strip()
        if not seed_with_token:  # the run made the tracker serve the data set: no token needed to seed it
            self.seeder = Cli(seeder_host, self.home, *seed)
            self.seeder.wait_for("seeding", lambda: self.seeder.of("Seeding"), 60)

    def join(self, host: Host, tmp: Path, *extra: str, unset: tuple[str, ...] = ()) -> Cli:
        return Cli(
            host, tmp / host.name, "join", self.run_id, "--tracker", self.url, "--json", *extra, unset=unset
        )

    def status(self, host: Host) -> str:
        done = host.run(
            [sys.executable, "-m", "crowdtrain", "status", self.run_id, "--tracker", self.url], timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def stop(self) -> None:
        """Ctrl-C the seeder (exit 130, interrupted) and the tracker (exit 0, "tracker stopped")."""
        self.stopped = (self.seeder.interrupt(), self.tracker.interrupt())

    def check_stopped(self) -> None:
        assert self.stopped == (130, 0), (self.seeder.tail(), self.tracker.tail())


def global_step(v: Cli) -> int:
    progress = v.of("Progress")
    return progress[-1]["global_step"] if progress else -1


def reachability(v: Cli) -> dict:
    """Where the tracker reaches ``v``, once both its checks answered (its newest Reachability sentence)."""
    v.wait_for(
        "a reachability sentence with both checks answered",
        lambda: any(e["bt_reachable"] is not None for e in v.of("Reachability")),
        60,
    )
    return v.of("Reachability")[-1]


def steps_taken(v: Cli, end: int) -> tuple[int, int]:
    """(steps this volunteer applied, steps of the run while it was in it), counting steps before ``end``
    (the run's step when the volunteers were stopped: the step in flight then does not count). The late
    one counts from the step it was at once the fetched state was loaded (it loaded or replayed those)."""
    done = [e["step"] for e in v.of("StepDone") if e["step"] < end]
    joined_at = v.of("Joined")[0]["global_step"]
    start = min(done) if v.of("StateLoaded") and done else joined_at
    return len(done), end - start


def run_with_a_late_volunteer(
    net: Network,
    tmp: Path,
    client_mode: set[str],
    averaging: str = "",
    nat: set[str] = frozenset(),
    backbone: set[str] = frozenset(),
) -> None:
    """``nat``: volunteers at home behind a router (``Network(homes=...)``), started with no flag;
    ``backbone``: started with ``--backbone`` (they compute no gradients)."""
    # (a) seeds as the README shows (registering with the admin token); (b) seeds without the token, the run
    # having made the tracker serve the data set
    pub = Published(net, tmp, seed_with_token=not (client_mode or nat), averaging=averaging)
    names = ["v1", "v2", "v3", "v4"]
    flags = {
        n: ["--client-mode"] if n in client_mode else ["--backbone"] if n in backbone else [] for n in names
    }
    vols = {n: pub.join(net.hosts[n], tmp, *flags[n]) for n in names[:3]}
    try:
        vols["v1"].wait_for(f"global step {LATE_AT}", lambda: global_step(vols["v1"]) >= LATE_AT, 180)
        vols["v4"] = pub.join(net.hosts["v4"], tmp, *flags["v4"])
        late = vols["v4"]
        late.wait_for(
            f"{LATE_STEPS} steps of the late volunteer", lambda: len(late.of("StepDone")) >= LATE_STEPS, 180
        )
        # (while they run: a check of an address behind NAT answers only when it times out)
        reaches = {n: reachability(v) for n, v in vols.items()}
        status = pub.status(net.hosts["v4"])
        end = int(re.search(r"global step\s+(\d+)", status).group(1))
    finally:
        # Ctrl-C, as a volunteer leaves: the last-started first, so the one server of (b) leaves last
        codes = {n: vols[n].interrupt(30) for n in reversed(list(vols))}
        pub.stop()
    pub.check_stopped()
    assert codes == {n: 130 for n in vols}, {n: vols[n].tail() for n in vols}

    ids = {n: v.of("Joined")[0]["peer_id"] for n, v in vols.items()}
    for n, v in vols.items():
        # the first lines say where it is reachable: at its own host's address, found by the tracker
        reach = reaches[n]
        if n in client_mode:
            assert reach["address"] is None and reach["asked_client_mode"]
        elif n in nat:  # told: the tracker tried its public address (its router's) and got no answer
            public = net.hosts[n].public_ip
            assert reach["reachable"] is not True and not reach["asked_client_mode"], reach
            assert reach["bt_address"].startswith(f"{public}:") and reach["bt_reachable"] is False, reach
        else:
            assert reach["address"].startswith(net.hosts[n].ip + ":") and reach["reachable"] is True, reach
        if n not in nat:
            assert reach["bt_address"].startswith(net.hosts[n].ip + ":") and reach["bt_reachable"], reach
        taken, present = steps_taken(v, end)
        assert present > 0 and taken >= 0.9 * present, f"{n} took {taken} of {present} steps:\n{v.tail()}"
        contributed = [e["contributed_samples"] for e in v.of("StepDone")]
        if n in backbone:  # it computed nothing, and said so from its first line
            assert not any(contributed) and v.of("Joined")[0]["backbone"], contributed
        elif n != "v4":
            assert any(contributed), f"{n} never contributed:\n{v.tail()}"
        # no round failed while the run was going (one in flight when they were stopped may)
        assert not [e for e in v.of("RoundFailed") if e["step"] < end], v.of("RoundFailed")
    # chunks passed between volunteers: some volunteer uploaded data set bytes (only volunteers download)
    uploaded = {n: max((e["uploaded"] for e in v.of("TorrentStats")), default=0) for n, v in vols.items()}
    assert any(uploaded.values()), uploaded
    # the late one loaded the state from donors on other hosts
    # (a second fetch happens when steps passed unseen while the first one downloaded)
    loads = vols["v4"].of("StateLoaded")
    host_of = {ids[n]: net.hosts[n].ip for n in names[:3] if n not in client_mode | nat}  # the serving ones
    assert loads and all(loaded["donors_used"] for loaded in loads), loads
    for donor in (d for loaded in loads for d in loaded["donors_used"]):  # "PEER_ID at HOST:PORT"
        peer_id, _, address = donor.partition(" at ")
        assert peer_id in host_of and address.startswith(host_of[peer_id] + ":"), (donor, host_of)
    # and from then on it computes its share of the steps (no one keeps it out, computing ahead or not)
    events = vols["v4"].events
    loaded_at = max(i for i, e in enumerate(events) if e.get("event") == "StateLoaded")
    after = [e for e in events[loaded_at:] if e.get("event") == "StepDone" and e["step"] < end]
    assert after and sum(e["contributed_samples"] > 0 for e in after) >= len(after) / 2, after
    # `crowdtrain status` lists every peer's reachability
    for n in names:
        [line] = [line for line in status.splitlines() if ids[n] in line] or [f"{n} ({ids[n]}) missing"]
        if n in client_mode:
            assert line.endswith("client mode (declared no address)"), status
        elif n in nat:
            assert "not reachable" in line, status
        else:
            assert f"reachable at {net.hosts[n].ip}:" in line and "not reachable" not in line, status
            assert ("backbone, reachable" in line) == (n in backbone), status
        if n not in nat:
            assert re.search(r"\d  reachable  ", line), status  # its BitTorrent port too (after the chunks)


def test_four_volunteers_on_four_hosts_train_together_started_as_the_readme_says(tmp_path):
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"]) as net:
        run_with_a_late_volunteer(net, tmp_path, client_mode=set())


def test_four_volunteers_on_four_hosts_train_together_with_delayed_updates(tmp_path):
    """The same with ``delay = 1``: volunteers compute the next step ahead while a step is averaged, and
    the late one catches up and takes its share of the steps."""
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"]) as net:
        run_with_a_late_volunteer(net, tmp_path, client_mode=set(), averaging="delay = 1\n")


HOMES = {"v2", "v3", "v4"}


def test_one_reachable_volunteer_and_three_behind_home_routers_train_together(tmp_path):
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"], homes=HOMES) as net:
        run_with_a_late_volunteer(net, tmp_path, client_mode=set(), nat=HOMES)


def test_in_local_steps_volunteers_behind_home_routers_send_only_and_a_late_one_catches_up(tmp_path):
    """Local-steps mode (``inner_steps = 2``): the NAT'd volunteers own no part and serve no state, the one
    reachable volunteer owns every part and serves the outer state the late one catches up to."""
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"], homes=HOMES) as net:
        run_with_a_late_volunteer(
            net, tmp_path, client_mode=set(), nat=HOMES, averaging="inner_steps = 2\ninner_batch_size = 32\n"
        )


def test_three_homes_and_a_backbone_train_together_and_a_late_home_catches_up_from_it(tmp_path):
    """No volunteer that computes is reachable: the backbone (``--backbone`` on a server, no gradients) owns
    every part, serves the state the late home loads, and the homes take the steps."""
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"], homes=HOMES) as net:
        run_with_a_late_volunteer(net, tmp_path, client_mode=set(), nat=HOMES, backbone={"v1"})


def test_volunteers_in_client_mode_by_choice_train_through_the_reachable_one(tmp_path):
    """``--client-mode`` on hosts the tracker could reach: they declare no address and own no part."""
    with Network(["tracker", "seeder", "v1", "v2", "v3", "v4"]) as net:
        run_with_a_late_volunteer(net, tmp_path, client_mode={"v2", "v3", "v4"})


def test_a_run_with_no_reachable_volunteer_waits_and_says_why(tmp_path):
    with Network(["tracker", "seeder", "v1", "v2", "v3"]) as net:
        pub = Published(net, tmp_path, seed_with_token=False)
        vols = {n: pub.join(net.hosts[n], tmp_path, "--client-mode") for n in ("v1", "v2", "v3")}
        try:
            for v in vols.values():
                # together they accumulate the run's target (256 samples), and each is told why nothing happens
                v.wait_for(
                    "the no-reachable-volunteer notice",
                    lambda v=v: any(
                        e["message"] and "no reachable volunteer" in e["message"] for e in v.of("RunNotice")
                    ),
                    180,
                )
            for v in vols.values():
                v.wait_for(
                    "the run's target accumulated",
                    lambda v=v: any(e["samples"] >= 256 for e in v.of("Progress")),
                    120,
                )
            time.sleep(3)  # and the step still does not close
            status = pub.status(net.hosts["v1"])
        finally:
            codes = {n: v.interrupt() for n, v in vols.items()}
            pub.stop()
    pub.check_stopped()
    assert codes == {n: 130 for n in vols}, {n: vols[n].tail() for n in vols}
    assert "global step   0" in status and "no reachable volunteer" in status, status
    assert status.count("client mode (declared no address)") == 3, status
    for v in vols.values():
        assert (
            not v.of("StepDone")
            and not v.of("RoundDone")
            and not v.of("RoundFailed")
            and not v.of("StepMissed")
        )
        assert all(e["global_step"] == 0 for e in v.of("Progress"))
        # nobody reset its parameters or went looking for a state: the accumulation only grew
        assert not v.of("StateLoaded") and not v.of("StateSyncStarted")
        samples = [e["samples"] for e in v.of("LocalTraining")]
        assert samples == sorted(samples), samples
        assert not any("initial parameters" in line for line in v.lines)
