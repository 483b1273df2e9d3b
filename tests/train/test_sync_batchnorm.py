"""Synchronized BatchNorm on 2 gloo processes against plain BatchNorm on the whole batch.

Each worker holds a slice of a fixed global batch (also of unequal sizes); outputs, input
gradients, summed weight / bias gradients and running statistics after two training steps
must equal those of plain BatchNorm on the concatenated batch. Converted modules keep their
state_dict keys, load into the plain modules and into bundles of plain modules.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timm.layers import BatchNormAct2d, SplitBatchNorm2d
from timm.layers import SyncBatchNormAct as TimmSyncBatchNormAct
from torch import nn

from raycompat.models import ModelBundle
from raycompat.models.psi import ProjectionMLP
from raycompat.train.sync_batchnorm import SyncBatchNorm, SyncBatchNormAct, synchronize_batchnorm

# (case id, BatchNorm factory, shape of one sample, rows of worker 0, rows of worker 1)
CASES = [
    ("1d-nc", lambda: nn.BatchNorm1d(3), (3,), 4, 4),
    ("1d-nc-uneven", lambda: nn.BatchNorm1d(3), (3,), 5, 2),
    ("1d-ncl-uneven", lambda: nn.BatchNorm1d(3), (3, 4), 1, 3),
    ("1d-cumulative", lambda: nn.BatchNorm1d(3, momentum=None), (3,), 3, 4),
    ("1d-no-affine", lambda: nn.BatchNorm1d(3, affine=False), (3,), 4, 4),
    ("2d", lambda: nn.BatchNorm2d(2), (2, 3, 3), 2, 2),
    ("2d-uneven", lambda: nn.BatchNorm2d(2, momentum=0.3), (2, 3, 3), 3, 1),
    ("3d", lambda: nn.BatchNorm3d(2), (2, 2, 2, 2), 2, 3),
    ("timm-act", lambda: BatchNormAct2d(2, act_layer=nn.Tanh), (2, 3, 3), 2, 3),
]
STEPS = 2


def _plain(case) -> nn.Module:
    """The case's BatchNorm with non-trivial weight, bias and running statistics (seeded)."""
    _, factory, *_ = case
    torch.manual_seed(0)
    bn = factory()
    with torch.no_grad():
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return bn


def _data(case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global input (channel means far from 0) and the weights of the summed loss."""
    _, _, sample, n0, n1 = case
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n0 + n1, *sample, generator=g) * 2 + 3
    return x, torch.randn(n0 + n1, *sample, generator=g)


def _run(bn: nn.Module, case, rows: slice):
    """``STEPS`` training steps on ``rows`` of the global batches: outputs, input and
    parameter gradients of every step, running statistics at the end."""
    steps = []
    for step in range(STEPS):
        x, r = _data(case, step)
        x = x[rows].clone().requires_grad_(True)
        bn.zero_grad()
        y = bn(x)
        (y * r[rows]).sum().backward()
        grads = [p.grad.clone() for p in bn.parameters()]
        if dist.is_initialized():
            for grad in grads:
                dist.all_reduce(grad)
        steps.append({"y": y.detach(), "x_grad": x.grad, "param_grads": grads})
    return steps, {k: v.clone() for k, v in bn.state_dict().items()}


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for case in CASES:
            n0 = case[3]
            rows = slice(0, n0) if rank == 0 else slice(n0, None)
            bn = synchronize_batchnorm(_plain(case)).train()
            results[case[0]] = _run(bn, case, rows)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("syncbn")
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_workers_match_plain_batchnorm_on_the_whole_batch(two_workers, case):
    n0 = case[3]
    ref_steps, ref_state = _run(_plain(case).train(), case, slice(None))
    for rank, rows in ((0, slice(0, n0)), (1, slice(n0, None))):
        steps, state = two_workers[rank][case[0]]
        for step, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
            where = (rank, step)
            assert torch.allclose(got["y"], ref["y"][rows], rtol=1e-5, atol=1e-5), where
            assert torch.allclose(got["x_grad"], ref["x_grad"][rows], rtol=1e-4, atol=1e-5), where
            assert len(got["param_grads"]) == len(ref["param_grads"])
            for g, r in zip(got["param_grads"], ref["param_grads"], strict=True):
                assert torch.allclose(g, r, rtol=1e-4, atol=1e-5), where
        assert state.keys() == ref_state.keys()
        assert int(state["num_batches_tracked"]) == STEPS
        for key in ref_state:
            assert torch.allclose(state[key].double(), ref_state[key].double(), atol=1e-5), key


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_process_is_plain_batchnorm(case):
    """No process group: train and eval mode are exactly plain BatchNorm."""
    plain, synced = _plain(case), synchronize_batchnorm(_plain(case))
    assert type(synced) is not type(plain)
    for mode in (True, False):
        x, _ = _data(case, 0)
        assert torch.equal(synced.train(mode)(x), plain.train(mode)(x))
    for key, value in plain.state_dict().items():
        assert torch.equal(synced.state_dict()[key], value), key


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn2 = nn.BatchNorm2d(2)
        self.block = nn.Sequential(BatchNormAct2d(2), nn.Flatten(), nn.Linear(2, 4))
        self.bn1 = nn.BatchNorm1d(4, affine=False, track_running_stats=False)
        self.psi = ProjectionMLP(4, 3, hidden_dim=5, num_blocks=2)

    def forward(self, x):
        return self.psi(self.bn1(self.block(self.bn2(self.conv(x)))))


def test_conversion_keeps_state_dict_modes_and_requires_grad():
    torch.manual_seed(0)
    plain = Net()
    plain.psi.requires_grad_(False).eval()
    plain.bn2.running_mean.normal_()
    plain.bn2.num_batches_tracked.fill_(7)
    source = Net()
    source.psi.requires_grad_(False).eval()
    source.load_state_dict(plain.state_dict())
    converted = synchronize_batchnorm(source)
    assert synchronize_batchnorm(converted) is converted  # already synchronized: left alone
    kinds = {name: type(m) for name, m in converted.named_modules()}
    assert kinds["bn2"] is SyncBatchNorm and kinds["bn1"] is SyncBatchNorm
    assert kinds["block.0"] is SyncBatchNormAct and kinds["psi.net.1"] is SyncBatchNorm
    assert isinstance(converted.block[0].act, nn.ReLU)
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for key, value in converted.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    fresh = Net()
    fresh.load_state_dict(converted.state_dict())  # strict: same keys, plain classes
    assert not converted.psi.training and not converted.psi.net[1].training
    assert converted.bn2.training and converted.bn1.running_mean is None
    assert not converted.psi.net[1].weight.requires_grad and converted.bn2.weight.requires_grad
    x = torch.randn(5, 1, 3, 3)
    for mode in (True, False):  # one process: plain BatchNorm in both modes
        assert torch.equal(converted.train(mode)(x), plain.train(mode)(x))


def test_cuda_conversion_uses_torch_sync_batchnorm():
    converted = synchronize_batchnorm(Net(), device="cuda")  # built on CPU: no GPU needed
    assert type(converted.bn2) is nn.SyncBatchNorm
    assert type(converted.block[0]) is TimmSyncBatchNormAct
    assert converted.state_dict().keys() == Net().state_dict().keys()


def test_unknown_batchnorm_subclass_is_refused():
    with pytest.raises(TypeError, match="SplitBatchNorm2d"):
        synchronize_batchnorm(nn.Sequential(SplitBatchNorm2d(2, num_splits=2)))


def test_converted_modules_export_plain_bundles(tmp_path):
    torch.manual_seed(0)
    psi = synchronize_batchnorm(ProjectionMLP(4, 3, hidden_dim=5, num_blocks=2))
    with torch.no_grad():
        psi.net[1].running_var.uniform_(0.5, 2.0)
    ModelBundle({"psi": psi}, {"method": "dmu"}).save(str(tmp_path / "bundle"))
    loaded = ModelBundle.load(str(tmp_path / "bundle")).modules["psi"]
    assert type(loaded.net[1]) is nn.BatchNorm1d
    x = torch.randn(6, 4)
    assert torch.equal(loaded(x), psi.eval()(x))
