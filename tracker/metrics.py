"""Prometheus metrics of one tracker (its own registry, so several trackers can live in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from crowdtrain.protocol.messages import StepRecord

if TYPE_CHECKING:
    from crowdtrain.tracker.runs import Runs
    from crowdtrain.tracker.swarm import Swarms


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "crowdtrain_tracker_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.announces = Counter("crowdtrain_tracker_announces", "BitTorrent announces received", registry=r)
        self.announce_errors = Counter(
            "crowdtrain_tracker_announce_failures", "announces answered with a failure reason", registry=r
        )
        self.errors = Counter(
            "crowdtrain_tracker_errors",
            "API requests answered with a 4xx or 5xx status",
            ["status"],
            registry=r,
        )
        self.steps = Counter("crowdtrain_tracker_steps", "collaborative steps closed", registry=r)
        self.round_size = Histogram(
            "crowdtrain_tracker_round_size",
            "members per all-reduce group",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.peers_online = Gauge(
            "crowdtrain_tracker_peers_online", "volunteers online, all runs", registry=r
        )
        self.swarm_peers = Gauge("crowdtrain_tracker_swarm_peers", "BitTorrent peers, all swarms", registry=r)
        self.runs = Gauge("crowdtrain_tracker_runs", "runs registered", registry=r)
        self._children: dict[tuple[str, int], Counter] = {}

    def bind(self, runs: Runs, swarms: Swarms) -> None:
        self.peers_online.set_function(runs.peers_online)
        self.swarm_peers.set_function(swarms.total_peers)
        self.runs.set_function(lambda: len(runs))

    def request(self, route: str, status: int) -> None:
        key = (route, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(route=route, status=str(status))
        child.inc()
        if status >= 400:
            self.errors.labels(status=str(status)).inc()

    def step_formed(self, record: StepRecord, sizes: list[int]) -> None:
        self.steps.inc()
        for size in sizes:
            self.round_size.observe(size)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
