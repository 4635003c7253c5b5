"""Weight is earned, not claimed (issue 29): identities are counted where their requests come from.

A real tracker, hand-signed requests. Each side sends from its own loopback address (127.0.0.2, 127.0.0.3:
the tracker sees them as two hosts, as it would two homes; 127.0.0.1, the machine's own processes, is not
counted), so nothing here passes because everything shares 127.0.0.1.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from crowdtrain.protocol.addresses import Origin, origin_of
from crowdtrain.protocol.client import TrackerClient
from crowdtrain.protocol.errors import TrackerError
from crowdtrain.protocol.messages import AveragingSpec
from crowdtrain.tracker.ledger import PROBATION_STEPS
from tests.sim import PingServer, SimVolunteer, make_run_create

HONEST_HOST, HOSTILE_HOST = "127.0.0.3", "127.0.0.2"
TARGET = 64


class FromAddress(TrackerClient):
    """A tracker client whose requests leave from ``source`` (another host, as far as the tracker knows)."""

    def __init__(self, url: str, source: str) -> None:
        super().__init__(url)
        self.source = source

    async def __aenter__(self) -> FromAddress:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(self.source, 0)))
        return self


def test_origins_are_parsed_addresses_and_this_machine_is_not_counted():
    assert origin_of("127.0.0.1") is None and origin_of("::1") is None and origin_of(None) is None
    assert origin_of("::ffff:127.0.0.1") is None
    assert origin_of("127.0.0.2") == Origin("127.0.0.2", "127.0.0.0/24")
    assert origin_of("::ffff:203.0.113.9") == Origin("203.0.113.9", "203.0.113.0/24")
    assert origin_of("2001:db8:1:2:3:4:5:6") == Origin("2001:db8:1:2::/64", "2001:db8:1::/48")
    assert origin_of("not an address") is None


async def _step(honest: SimVolunteer, liars: list[SimVolunteer], step: int) -> dict[str, int]:
    """One step: the liars claim the whole target at an absurd rate from their first heartbeat of it, the
    honest volunteer computes what it is allotted (at 100 samples/s); all say ready. The weights averaged."""
    for liar in liars:
        await liar.heartbeat(step, TARGET, samples_per_s=1e12)
    # the honest volunteer computes its allotment and reports it; twice is what an unhindered step takes
    # (the first heartbeat learns the allotment, the second reports it done): a capped liar's rate must not
    # shrink what it is allotted to a trickle that needs a heartbeat per sample
    held = 0
    for _ in range(4):
        reply = await honest.heartbeat(step, held, samples_per_s=100.0)
        if reply.step_closed:
            break
        held = max(held, reply.allotment or 0)
        for liar in liars:  # (they keep claiming)
            await liar.heartbeat(step, TARGET, samples_per_s=1e12)
    assert reply.step_closed, f"step {step} did not close after 4 heartbeats of the honest peer: {reply}"
    replies = await asyncio.gather(honest.ready(step, held), *(liar.ready(step, TARGET) for liar in liars))
    assert replies[0].status == "group", replies[0]
    members = {m.peer_id: m.weight for m in replies[0].assignment.members}
    for a in (r.assignment for r in replies if r.assignment is not None):
        assert a.step == step
    return members


async def test_two_identities_from_one_address_claiming_huge_rates_weigh_no_more_than_an_honest_volunteer(
    tracker, admin
):
    """A live run with one honest volunteer; two identities join from one other address and claim the whole
    target at 10¹² samples/s from their first heartbeat, every step. Before issue 29 they were credited 32 + 32
    of 64 and closed each step on their own (89 % of the weight). Now the identities of one address share one
    share cap (32 of 64), on probation they count at the honest peer's rate, and past it their capped rate no
    longer shrinks the honest peer's share: every step the two weigh no more than the honest volunteer, and
    the step is never over its target."""
    spec = make_run_create(target_batch_size=TARGET, averaging=AveragingSpec(group_size=4, gather_s=2.0))
    run_id = (await admin.create_run(spec)).run_id
    async with (
        FromAddress(tracker.url, HONEST_HOST) as honest_client,
        FromAddress(tracker.url, HOSTILE_HOST) as hostile_client,
        PingServer(host=HONEST_HOST) as ping,
    ):
        honest = SimVolunteer(honest_client, run_id)
        honest.address = ":" + ping.address.rpartition(":")[2]  # reachable: it owns the part
        await honest.join(honest.address)
        ping.peer_id = honest.peer_id
        await honest.wait_reachable()
        for step in range(PROBATION_STEPS):  # the run is live: the honest volunteer has taken part
            assert await _step(honest, [], step) == {honest.peer_id: TARGET}
        liars = [SimVolunteer(hostile_client, run_id) for _ in range(2)]
        for liar in liars:
            await liar.join()
        for step in range(PROBATION_STEPS, 3 * PROBATION_STEPS):  # on probation, then past it
            weights = await _step(honest, liars, step)
            mine = weights[honest.peer_id]
            theirs = sum(weights.get(liar.peer_id, 0) for liar in liars)
            assert theirs <= mine, f"step {step}: the two identities weigh {theirs}, the honest one {mine}"
            assert theirs <= TARGET // 2 and mine + theirs <= TARGET, weights
        status = await admin.status(run_id)
        assert status.global_step == 3 * PROBATION_STEPS


async def test_new_identities_from_other_addresses_count_at_the_median_rate_while_on_probation(
    tracker, admin
):
    """Two identities from two addresses (no shared cap) claim 10¹² samples/s: while on probation they
    count at the established peers' median rate, so each is allotted and credited no more than the honest
    volunteer. (Past probation a claim is believed within the share cap: what stops a patient liar with
    many addresses is a spot-check of its work, docs/security.md.)"""
    spec = make_run_create(target_batch_size=TARGET, averaging=AveragingSpec(group_size=4, gather_s=2.0))
    run_id = (await admin.create_run(spec)).run_id
    async with (
        FromAddress(tracker.url, HONEST_HOST) as honest_client,
        FromAddress(tracker.url, HOSTILE_HOST) as one,
        FromAddress(tracker.url, "127.0.0.4") as other,
        PingServer(host=HONEST_HOST) as ping,
    ):
        honest = SimVolunteer(honest_client, run_id)
        await honest.join(":" + ping.address.rpartition(":")[2])
        ping.peer_id = honest.peer_id
        await honest.wait_reachable()
        for step in range(PROBATION_STEPS):
            await _step(honest, [], step)
        liars = [SimVolunteer(one, run_id), SimVolunteer(other, run_id)]
        for liar in liars:
            await liar.join()
        for step in range(PROBATION_STEPS, 2 * PROBATION_STEPS):
            weights = await _step(honest, liars, step)
            for liar in liars:
                assert weights.get(liar.peer_id, 0) <= weights[honest.peer_id], (step, weights)


@pytest.mark.tracker_config(max_peers_per_address=2)
async def test_live_identities_per_address_are_bounded_with_a_sentence_and_this_machine_is_not_counted(
    tracker, admin
):
    run_id = (await admin.create_run(make_run_create())).run_id
    async with FromAddress(tracker.url, HOSTILE_HOST) as there, FromAddress(tracker.url, "127.0.0.1") as here:
        first, second, third = (SimVolunteer(there, run_id) for _ in range(3))
        await first.join()
        await second.join()
        with pytest.raises(
            TrackerError, match=r"already has 2 volunteers from your address \(127\.0\.0\.2\)"
        ) as e:
            await third.join()
        assert e.value.status == 429
        for _ in range(3):  # the machine's own processes (the demo, a volunteer beside its tracker)
            await SimVolunteer(here, run_id).join()
        await first.leave()
        await third.join()  # a place freed by one that left
        assert (await third.heartbeat(0, 0)).global_step == 0
