"""Home links: four volunteers on four hosts whose uplinks are shaped to 2 Mbit/s (``tbf``; this kernel has no
``netem``, so rate but no added delay), in local-steps mode as a new publisher sets it: ``inner_steps = "auto"``
alone (the tracker chooses each round's H; the rest the local-steps defaults: int2, delay 1), started with the
README's commands. Every volunteer takes every global step, the loss falls, every round's H is recorded within
its bounds, and the all-reduce's bytes really crossed the shaped links (the ``tbf`` qdiscs' own counters), not
loopback.

What such a link costs in compute share is a benchmark's figure (``bench/homelinks.py``), not a test's.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys

import pytest

from tests.netns import Host, Network, requires_netns
from tests.test_across_hosts import Published, global_step
from tests.test_local_steps import inner_steps_of

pytestmark = [requires_netns, pytest.mark.slow, pytest.mark.timeout(500)]

UPLINK = "2mbit"
ROUNDS = 3  # global steps (outer rounds) every volunteer takes together
# the model: tiny-gpt d_model 128 × 4 layers (0.86 M parameters); a round is 10 × 256 samples
HOME_TOML = """\
name = "home links"
target_batch_size = 256
micro_batch_size = 16

[model]
recipe = "tiny-gpt"
[model.args]
d_model = 128
n_layer = 4
n_head = 4
seq_len = 64

[dataset]
dir = "data"

[optimizer]
lr = 0.001

[averaging]
group_size = 4
codec = "sparse"
inner_steps = 10
inner_batch_size = 64
step_timeout_s = 600
"""


# what a new publisher writes: the run file above with [averaging] inner_steps = "auto" alone (and the timeout)
AUTO_TOML = (
    HOME_TOML.replace('codec = "sparse"\n', "")
    .replace("inner_steps = 10\n", 'inner_steps = "auto"\n')
    .replace("inner_batch_size = 64\n", "")
)


def tbf_bytes_sent(host: Host) -> int:
    """Bytes the host's ``tbf`` qdisc on eth0 has sent (its uplink's own counter)."""
    done = host.run([shutil.which("tc") or "/usr/sbin/tc", "-s", "qdisc", "show", "dev", "eth0"], timeout=10)
    assert done.returncode == 0, done.stderr
    found = re.search(r"qdisc tbf .*?Sent (\d+) bytes", done.stdout, re.S)
    assert found, f"no tbf qdisc on {host.name}'s eth0:\n{done.stdout}"
    return int(found.group(1))


def test_four_home_volunteers_on_2_mbit_uplinks_take_every_local_step_and_learn(tmp_path):
    names = ["v1", "v2", "v3", "v4"]
    with Network(["tracker", "seeder", *names]) as net:
        for n in names:
            net.hosts[n].shape(UPLINK)
        pub = Published(net, tmp_path, run_toml=AUTO_TOML)
        vols = {n: pub.join(net.hosts[n], tmp_path) for n in names}
        sent_before = {n: tbf_bytes_sent(net.hosts[n]) for n in names}
        try:
            for v in vols.values():
                v.wait_for(
                    f"{ROUNDS} global steps",
                    lambda v=v: sum(e["step"] < ROUNDS + 1 for e in v.of("StepDone")) >= ROUNDS,
                    360,
                )
            end = min(global_step(v) for v in vols.values())
            status = pub.status(net.hosts["seeder"])
        finally:
            codes = {n: v.interrupt(60) for n, v in vols.items()}
            pub.stop()
        sent = {n: tbf_bytes_sent(net.hosts[n]) - sent_before[n] for n in names}
    pub.check_stopped()
    assert codes == {n: 130 for n in names}, {n: v.tail() for n, v in vols.items()}

    # every volunteer took every global step from the first one all four took together, none was missed
    first = max(min(e["step"] for e in v.of("StepDone")) for v in vols.values())
    assert first <= 1 and end >= first + ROUNDS - 1, (first, end)
    for n, v in vols.items():
        done = sorted(e["step"] for e in v.of("StepDone") if first <= e["step"] < end)
        assert done == list(range(first, end)), f"{n} took steps {done} of {first}..{end - 1}:\n{v.tail()}"
        assert not [e for e in v.of("StepMissed") if e["step"] < end], v.of("StepMissed")
        assert not [e for e in v.of("RoundFailed") if e["step"] < end], v.of("RoundFailed")
        # each took several inner steps in a round: local mode, not every-step
        inner = [e["inner_steps"] for e in v.of("LocalTraining") if e.get("inner_steps")]
        assert inner and max(inner) >= 2, inner
    # the loss fell from the first round to the last (each round's mean training loss over the volunteers)
    # (a volunteer that computed nothing in a round reports no loss for it)
    losses = {
        s: statistics.fmean(
            e["loss"]
            for v in vols.values()
            for e in v.of("StepDone")
            if e["step"] == s and e["loss"] is not None
        )
        for s in (first, end - 1)
    }
    assert losses[end - 1] < losses[first], losses
    # the tracker chose each round's H, within the default bounds (16 to 100), from 16 before it measured
    assert "H chosen by the tracker each round" in status, status
    chosen = inner_steps_of(status)
    assert len(chosen) >= ROUNDS and chosen[0] == 16 and all(16 <= h <= 100 for h in chosen), status
    # the rounds' bytes crossed the shaped uplinks: each volunteer's qdisc sent at least what it says it sent
    for n, v in vols.items():
        said = sum(e["bytes_sent"] for e in v.of("RoundDone"))
        assert said > 0 and sent[n] >= said, (n, said, sent[n])


def test_the_shaped_uplink_limits_what_a_host_sends(tmp_path):
    """The helper's ``shape`` is real: 1 MB out of a host with a 2 Mbit/s uplink takes about 4 s (a wide margin:
    ≥ 2.5 s), and the same 1 MB back the other way, through an unshaped uplink, under half of that."""
    with Network(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        a.shape(UPLINK)
        shaped_s, unshaped_s = send_1mb(a, b), send_1mb(b, a)
    assert shaped_s >= 2.5 and unshaped_s < shaped_s / 2, (shaped_s, unshaped_s)


def send_1mb(sender: Host, receiver: Host) -> float:
    """Seconds for ``sender`` to send 1 MB over TCP to a sink on ``receiver`` (until the sink closed)."""
    sink = receiver.popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
        done = sender.run([sys.executable, "-c", SEND.format(ip=receiver.ip)], timeout=60)
        assert done.returncode == 0, done.stderr
        return float(done.stdout)
    finally:
        sink.kill()
        sink.wait(5)


SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9099)); s.listen()
print("listening", flush=True)
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""
SEND = """
import socket, time
c = socket.create_connection(("{ip}", 9099)); t = time.monotonic()
c.sendall(b"x" * 1_000_000); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.monotonic() - t)
"""
