"""State snapshots: safetensors + JSON header, round trip into a fresh model and optimizer, no pickle."""

from __future__ import annotations

import hashlib

import pytest
import safetensors.torch
import torch
from torch import nn

from crowdtrain.protocol.errors import ProtocolError
from crowdtrain.volunteer.state.snapshot import load_snapshot
from tests.snapshots import content, make_snapshot, manifest_of

KiB = 1 << 10


class Tied(nn.Module):
    """A tiny LM-like model whose head shares the embedding's weight (safetensors refuses shared tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    sched.step()


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return model, opt, sched


def test_round_trip_gives_identical_outputs_and_optimizer_continues_identically(tmp_path):
    torch.manual_seed(0)
    x = torch.randint(0, 50, (4, 7))
    model, opt, sched = build()
    train_step(model, opt, sched, x)
    train_step(model, opt, sched, x)

    snap = make_snapshot(
        tmp_path,
        run_id="r1",
        step=2,
        recipe="tiny",
        args={"width": 16, "tied": True},
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        range_bytes=64 * KiB,
    )
    data = content(snap)
    assert snap.manifest.content_hash == hashlib.sha256(data).hexdigest()
    assert snap.version.size == len(data) == snap.manifest.total_bytes
    assert snap.version.step == 2

    loaded = load_snapshot(data)
    assert (loaded.run_id, loaded.step, loaded.recipe, loaded.args) == (
        "r1",
        2,
        "tiny",
        {"width": 16, "tied": True},
    )

    torch.manual_seed(1)  # a different init, overwritten by the loaded state
    fresh, fresh_opt, fresh_sched = build()
    fresh.load_state_dict(loaded.model_state)
    fresh_opt.load_state_dict(loaded.optimizer_state)
    fresh_sched.load_state_dict(loaded.scheduler_state)
    assert fresh.head.weight is fresh.emb.weight  # the tie survives loading
    assert torch.equal(fresh(x), model(x))

    for _ in range(3):
        train_step(model, opt, sched, x)
        train_step(fresh, fresh_opt, fresh_sched, x)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_snapshot_is_plain_safetensors_with_header_metadata_and_ranges_hash_the_data(tmp_path):
    model, opt, _ = build()
    snap = make_snapshot(
        tmp_path,
        run_id="r1",
        step=0,
        recipe="tiny",
        args={},
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=None,
        range_bytes=64 * KiB,
    )
    data = content(snap)
    tensors = safetensors.torch.load(data)
    assert "model.emb.weight" in tensors and "model.head.weight" not in tensors  # stored once, aliased
    rb = snap.manifest.range_bytes
    assert len(snap.manifest.range_sha256) == -(-len(data) // rb)
    for i, h in enumerate(snap.manifest.range_sha256):
        assert hashlib.sha256(data[i * rb : (i + 1) * rb]).hexdigest() == h
    assert manifest_of(data, run_id="r1", step=0, range_bytes=rb) == snap.manifest


def test_load_refuses_safetensors_not_made_by_crowdtrain():
    data = safetensors.torch.save({"w": torch.zeros(3)})
    with pytest.raises(ProtocolError, match="lacks the 'crowdtrain' metadata"):
        load_snapshot(data)


def test_load_refuses_garbage_and_truncated_bytes(tmp_path):
    model, opt, _ = build()
    snap = make_snapshot(
        tmp_path,
        run_id="r1",
        step=0,
        recipe="tiny",
        args={},
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scheduler_state=None,
    )
    with pytest.raises(ProtocolError):
        load_snapshot(b"\x00" * 3)
    with pytest.raises(ProtocolError):
        load_snapshot(b"\xff" * 64)
    with pytest.raises(ProtocolError):
        load_snapshot(content(snap)[: snap.size // 2])


def test_unexpected_tensor_name_is_refused():
    meta = (
        '{"format": 1, "run_id": "r", "step": 0, "recipe": "x", "args": {}, "param_groups": [],'
        ' "optim_scalars": {}, "scheduler": null, "aliases": {}}'
    )
    data = safetensors.torch.save({"evil": torch.zeros(2)}, metadata={"crowdtrain": meta})
    with pytest.raises(ProtocolError, match="unexpected tensor 'evil'"):
        load_snapshot(data)
