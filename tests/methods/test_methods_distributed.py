"""Every method on 2 DDP workers (torch.distributed, gloo, 2 local processes) against 1 process.

Convention checked: each worker holds half of a fixed global batch; DDP averages the workers'
gradients; the result must equal the one-process gradient of the whole batch, and the mean of
the workers' losses the one-process loss (gathered negatives, batch-softmax weights and the
per-epoch passes included). Every BatchNorm (the test embedder's, psi's, rho's, psi_rev's)
runs in train mode: on 2 workers it is synchronized as the training loop does, so its batch
statistics and running statistics equal the one-process ones. Then every method trains a few
DDP steps on 2 workers, the workers stay in sync (parameters and running statistics), and its
exported modules load back from a bundle of plain modules.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_methods_losses import BATCH_LABELS, D_OLD, build, make_batch, slice_batch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from raycompat.models import ModelBundle
from raycompat.train.sync_batchnorm import SyncBatchNorm, synchronize_batchnorm

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
        "mcl-bn",  # rho and psi_rev with a [Linear-BN-ReLU] block each
        "mcl",
        {"rho_blocks": 1, "rho_hidden": 8, "psi_rev_blocks": 1, "psi_rev_hidden": 8},
        None,
        "cosface",
    ),
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
    # the field's baselines (test_field_methods.py)
    ("lwf", "lwf", {"scale": 10.0, "teacher_scale": 10.0}, None, "cosface"),
    ("fd", "fd", {}, None, "cosface"),
    ("fd-new", "fd", {"indicator": "new"}, None, "softmax"),
    ("lce", "lce", {}, None, "cosface"),
    ("lce-all", "lce", {"centre_classes": "all"}, None, "arcface"),
    ("unibct", "unibct", {"tau": 0.5}, None, "cosface"),
    # the boundary over the training set the workers shard (the old split is not in this harness)
    ("advbct", "advbct", {"grl_alpha": 0.5, "boundary_split": "new"}, None, "cosface"),
    (
        "advbct-dann",
        "advbct",
        {"centre_classes": "all", "boundary_split": "new", "discriminator": "joint"},
        None,
        "cosface",
    ),
    ("bt2", "bt2", {"extra_dim": 4}, None, "cosface"),
    ("dsimplex", "dsimplex", {"classes": D_OLD + 1}, D_OLD, "dsimplex"),
    ("dsimplex-hoc", "dsimplex", {"classes": D_OLD + 1, "loss": "hoc"}, D_OLD, "dsimplex"),
    ("fct", "fct", {"hidden": 16, "batchnorm": "eval"}, None, "cosface"),  # h in eval mode
    ("fct-bn-train", "fct", {"hidden": 16, "batchnorm": "train"}, None, "cosface"),
]
LOCAL = len(BATCH_LABELS) // 2


class BatchNormEmbedder(nn.Module):
    """A BatchNorm1d (non-trivial affine, seeded) on the input, then the test embedder (not
    after it: the embedder's bias would have a zero gradient, rounding noise only)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.embed_dim = inner, inner.embed_dim
        self.bn = nn.BatchNorm1d(inner.fc.in_features)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5, generator=g)
            self.bn.bias.normal_(0.0, 0.1, generator=g)

    def forward(self, x):
        return self.inner(self.bn(x.flatten(1)))


def _module(case, world: int):
    """The case's TrainingModule, every BatchNorm in train mode (a frozen embedder in eval
    mode, as the loop runs it); on more than one worker synchronized as the loop does."""
    _, method, options, dim, head = case
    module = build(method, options, **({"new_dim": dim} if dim else {}), head=head)
    module.embedder = BatchNormEmbedder(module.embedder)
    module.train()
    if not module.method.trains_embedder:
        module.embedder.requires_grad_(False).eval()
    if world > 1:
        module = synchronize_batchnorm(module, torch.device("cpu"))
    return module


def _running_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every BatchNorm buffer (running mean / var, batches tracked), by name."""
    return {
        n: b.clone()
        for n, b in module.named_buffers()
        if n.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }


def _biases_before_batchnorm(module: nn.Module) -> set[str]:
    """Names of the Linear biases a BatchNorm in train mode follows: their gradient is 0 (the
    batch mean removes them), so what is left is rounding noise."""
    names = set()
    for prefix, seq in module.named_modules():
        if isinstance(seq, nn.Sequential):
            for i in range(len(seq) - 1):
                follows = isinstance(seq[i + 1], _BatchNorm) and seq[i + 1].training
                if isinstance(seq[i], nn.Linear) and follows:
                    names.add(f"{prefix}.{i}.bias")
    return names


def _gradient_case(case, world: int, rank: int):
    """Loss, DDP-averaged gradients, method buffers and BatchNorm running statistics after
    the per-epoch pass and one step."""
    module = _module(case, world)
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
    losses = dict(zip(sorted(terms), losses, strict=False))
    return losses, grads, buffers, _running_stats(module)


def _training_case(case, rank: int, out_dir: str):
    """Three DDP steps on 2 workers; parameters and running statistics in sync; exports saved
    by rank 0 and reloaded."""
    module = _module(case, world=2)
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
    stats = torch.cat([b.double().flatten() for b in _running_stats(module).values()])
    stats_copies = [torch.empty_like(stats) for _ in range(2)]
    dist.all_gather(stats_copies, stats)
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
            ) and not any(isinstance(m, SyncBatchNorm) for m in loaded.modules[name].modules())
    return {
        "losses": losses,
        "in_sync": torch.equal(copies[0], copies[1]),
        "stats_in_sync": torch.allclose(stats_copies[0], stats_copies[1], rtol=1e-6, atol=1e-7),
        "synchronized": sum(isinstance(m, SyncBatchNorm) for m in module.modules()),
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
        dist.barrier()  # neither worker tears its connections down while the other still reads
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
    losses1, grads1, buffers1, stats1 = _gradient_case(case, world=1, rank=0)
    losses2, grads2, buffers2, stats2 = two_workers["gradients"][case[0]]
    assert losses1.keys() == losses2.keys()
    for key in losses1:
        assert torch.allclose(losses1[key], losses2[key], rtol=1e-5, atol=1e-6), (
            key,
            losses1,
            losses2,
        )
    assert grads1.keys() == grads2.keys() and grads1
    reference = _module(case, world=1)
    zero = _biases_before_batchnorm(reference)
    for name in grads1:
        if name in zero:
            assert grads1[name].abs().max() < 1e-4 and grads2[name].abs().max() < 1e-4, name
            continue
        assert grads1[name].abs().sum() > 0 or name.startswith("head"), name
        # float32 rounding through the BatchNorm backward scales with the largest entry
        atol = max(1e-6, 1e-5 * float(grads1[name].abs().max()))
        assert torch.allclose(grads1[name], grads2[name], rtol=1e-4, atol=atol), name
    # Per-epoch passes (BCT-sys rows, prototypes, perturbations) do not depend on the workers.
    assert buffers1.keys() == buffers2.keys()
    for name in buffers1:
        assert torch.allclose(buffers1[name], buffers2[name], rtol=1e-5, atol=1e-6), name
    # BatchNorm running statistics: those of the whole batch (synchronized BatchNorm).
    assert stats1.keys() == stats2.keys() and "embedder.bn.running_mean" in stats1
    ran = {n.rsplit(".", 1)[0] for n in stats1 if n.endswith("num_batches_tracked") and stats1[n]}
    assert ("embedder.bn" in ran) == reference.method.trains_embedder, ran  # frozen: eval mode
    norms = reference.method.named_modules()  # those in train mode (fct: eval by default)
    method_norms = {f"method.{n}" for n, m in norms if isinstance(m, _BatchNorm) and m.training}
    assert method_norms <= ran, (method_norms, ran)
    for name in stats1:
        assert torch.allclose(stats1[name], stats2[name], rtol=1e-5, atol=1e-6), (
            name,
            stats1[name],
            stats2[name],
        )


def test_per_epoch_passes_are_not_trivial(two_workers):
    buffers = {case[0]: two_workers["gradients"][case[0]][2] for case in CASES}
    assert buffers["bct-sys"]["synth_rows"].abs().sum() > 0
    assert buffers["p2s"]["old_prototypes"].abs().sum() > 0
    ndpp = buffers["ndpp"]
    assert not torch.allclose(ndpp["pseudo_prototypes"], ndpp["old_prototypes"])
    assert buffers["odpp"]["perturbation"].abs().sum() > 0


def test_field_method_passes_are_not_trivial(two_workers):
    buffers = {case[0]: two_workers["gradients"][case[0]][2] for case in CASES}
    assert buffers["lce"]["has_centre"].tolist() == [True, True, True, False, False]
    assert buffers["lce"]["boundaries"][:3].abs().min() > 0
    assert buffers["unibct"]["prototypes"].abs().sum() > 0
    assert buffers["advbct"]["max_radius"][:3].min() > 0
    assert buffers["advbct-dann"]["has_boundary"].all()  # every class has a centre with "all"
    assert buffers["bt2"]["pseudo_classifier"].abs().sum(dim=1).min() > 0  # a mean per class


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_method_trains_on_two_workers_and_exports_load(two_workers, case):
    result = two_workers["training"][case[0]]
    assert all(torch.isfinite(torch.tensor(result["losses"]))), result
    assert result["in_sync"] and result["moved"]
    assert result["stats_in_sync"] and result["synchronized"] > 0
    expected = {
        "dmu": {"psi"},
        "mcl": {"rho", "psi_rev"},
        "cl": {"rho", "psi_rev"},
        "rqt": {"rho", "psi_rev"},
        "fct": {"fct"},
    }.get(case[1], set())
    assert set(result["exported"]) == expected and all(result["exported"].values())
