"""Every method on 2 DDP workers (torch.distributed, gloo, 2 local processes) against 1 process.

Convention checked: each worker holds half of a fixed global batch; DDP averages the workers'
gradients; the result must equal the one-process gradient of the whole batch, and the mean of
the workers' losses the one-process loss (gathered negatives, batch-softmax weights and the
per-epoch passes included). Then every method trains a few DDP steps on 2 workers, the
workers stay in sync, and its exported modules load back from a bundle.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_methods_losses import BATCH_LABELS, D_OLD, build, make_batch, slice_batch
from torch.nn.parallel import DistributedDataParallel

from raycompat.models import ModelBundle

# (case id, method, options, new embedding dim, head kind)
CASES = [
    ("l2", "l2", {}, D_OLD, "cosface"),
    ("bct-sys", "bct", {"variant": "sys"}, None, "cosface"),
    ("bct-beta", "bct", {"variant": "beta"}, None, "softmax"),
    ("bct-kd", "bct", {"variant": "kd"}, None, "cosface"),
    ("contrastive", "contrastive", {"tau": 0.2}, None, "cosface"),
    ("contrastive-triplet", "contrastive", {"form": "triplet", "margin": 0.8}, None, "cosface"),
    ("ract", "ract", {"tau": 0.2}, None, "cosface"),
    ("ract-triplet", "ract", {"form": "triplet"}, None, "cosface"),
    ("dmu", "dmu", {"psi_hidden": 16}, None, "arcface"),
    (
        "dmu-lc",
        "dmu",
        {"psi_hidden": 16, "discriminativeness": "least_confidence"},
        None,
        "arcface",
    ),
    ("mcl", "mcl", {"psi_rev_blocks": 0, "temperature": 0.5}, None, "cosface"),
    (
        "mcl-hard",
        "mcl",
        {"psi_rev_blocks": 0, "hard_mining": True, "distance": "l2"},
        None,
        "cosface",
    ),
    ("cl", "cl", {"psi_rev_blocks": 0}, None, "cosface"),
    ("rqt", "rqt", {"psi_rev_blocks": 0}, None, "cosface"),
    ("p2s", "p2s", {}, None, "cosface"),
    ("ndpp", "ndpp", {"alpha_old": 0.5, "alpha_new": 0.5, "k": 2}, None, "cosface"),
    (
        "odpp",
        "odpp",
        {"theta_old": 0.0, "theta_new": 0.0, "perturb_lr": 0.05, "perturb_epochs": 5},
        None,
        "cosface",
    ),
]
LOCAL = len(BATCH_LABELS) // 2


def _module(case):
    _, method, options, dim, head = case
    module = build(method, options, **({"new_dim": dim} if dim else {}), head=head)
    module.train()
    if not module.method.trains_embedder:
        module.embedder.eval()
    # BatchNorm statistics are per worker under DDP (no SyncBatchNorm), so a BN module in train
    # mode cannot match the one-process batch statistics; psi is compared in eval mode.
    if hasattr(module.method, "psi"):
        module.method.psi.eval()
    return module


def _gradient_case(case, world: int, rank: int):
    """Loss, DDP-averaged gradients and method buffers after the per-epoch pass and one step."""
    module = _module(case)
    module.method.on_epoch_start(0, module)
    batch = make_batch(BATCH_LABELS, seed=3)
    if world > 1:
        batch = slice_batch(batch, slice(rank * LOCAL, (rank + 1) * LOCAL))
        model = DistributedDataParallel(module, find_unused_parameters=False)
    else:
        model = module
    terms = model(batch)
    terms["loss"].backward()
    losses = torch.stack([terms[k].detach() for k in sorted(terms)])
    if world > 1:
        dist.all_reduce(losses)
        losses /= world
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in module.method.named_buffers()}
    return dict(zip(sorted(terms), losses, strict=False)), grads, buffers


def _training_case(case, rank: int, out_dir: str):
    """Three DDP steps on 2 workers; parameters in sync; exports saved by rank 0 and reloaded."""
    module = _module(case)
    model = DistributedDataParallel(module, find_unused_parameters=False)
    optimizer = torch.optim.SGD(
        [p for p in module.parameters() if p.requires_grad], lr=0.05, momentum=0.9
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    losses = []
    for step in range(3):
        module.method.on_epoch_start(step, module)
        batch = slice_batch(
            make_batch(BATCH_LABELS, seed=10 + step), slice(rank * LOCAL, (rank + 1) * LOCAL)
        )
        terms = model(batch)
        optimizer.zero_grad()
        terms["loss"].backward()
        optimizer.step()
        losses.append(float(terms["loss"]))
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    copies = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(copies, flat)
    moved = any(not torch.equal(before[n], p) for n, p in module.named_parameters() if n in before)
    exported = {}
    if rank == 0:
        path = os.path.join(out_dir, case[0])
        ModelBundle({"head": module.head, **module.method.exports()}, {"method": case[1]}).save(
            path
        )
        loaded = ModelBundle.load(path)
        for name, exported_module in module.method.exports().items():
            state = exported_module.state_dict()
            exported[name] = all(
                torch.equal(state[k], v) for k, v in loaded.modules[name].state_dict().items()
            )
    return {
        "losses": losses,
        "in_sync": torch.equal(copies[0], copies[1]),
        "moved": moved,
        "exported": exported,
    }


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gradients = {case[0]: _gradient_case(case, world, rank) for case in CASES}
        training = {case[0]: _training_case(case, rank, out_dir) for case in CASES}
        if rank == 0:
            torch.save(
                {"gradients": gradients, "training": training}, os.path.join(out_dir, "results.pt")
            )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_workers_match_one_process(two_workers, case):
    torch.set_num_threads(1)
    losses1, grads1, buffers1 = _gradient_case(case, world=1, rank=0)
    losses2, grads2, buffers2 = two_workers["gradients"][case[0]]
    assert losses1.keys() == losses2.keys()
    for key in losses1:
        assert torch.allclose(losses1[key], losses2[key], rtol=1e-5, atol=1e-6), (
            key,
            losses1,
            losses2,
        )
    assert grads1.keys() == grads2.keys() and grads1
    for name in grads1:
        assert grads1[name].abs().sum() > 0 or name.startswith("head"), name
        assert torch.allclose(grads1[name], grads2[name], rtol=1e-4, atol=1e-6), name
    # Per-epoch passes (BCT-sys rows, prototypes, perturbations) do not depend on the workers.
    assert buffers1.keys() == buffers2.keys()
    for name in buffers1:
        assert torch.allclose(buffers1[name], buffers2[name], rtol=1e-5, atol=1e-6), name


def test_per_epoch_passes_are_not_trivial(two_workers):
    buffers = {case[0]: two_workers["gradients"][case[0]][2] for case in CASES}
    assert buffers["bct-sys"]["synth_rows"].abs().sum() > 0
    assert buffers["p2s"]["old_prototypes"].abs().sum() > 0
    ndpp = buffers["ndpp"]
    assert not torch.allclose(ndpp["pseudo_prototypes"], ndpp["old_prototypes"])
    assert buffers["odpp"]["perturbation"].abs().sum() > 0


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_method_trains_on_two_workers_and_exports_load(two_workers, case):
    result = two_workers["training"][case[0]]
    assert all(torch.isfinite(torch.tensor(result["losses"]))), result
    assert result["in_sync"] and result["moved"]
    expected = {
        "dmu": {"psi"},
        "mcl": {"rho", "psi_rev"},
        "cl": {"rho", "psi_rev"},
        "rqt": {"rho", "psi_rev"},
    }.get(case[1], set())
    assert set(result["exported"]) == expected and all(result["exported"].values())
