"""Every method's loss against a direct computation on tiny hand-made tensors (one process).

The small stand-in models and data defined here are reused by test_methods_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError
from raycompat.methods import (
    MethodContext,
    TrainBatch,
    TrainingModule,
    build_method,
    parse_method_options,
)
from raycompat.methods.dmu import discriminativeness, selective_weights
from raycompat.methods.gathered import compatibility_logits, compatibility_triplet, hardest_half
from raycompat.methods.ndpp import ndpp_prototypes, neighbour_repulsion
from raycompat.methods.odpp import optimise_perturbation, perturbation_objective, random_pairs
from raycompat.methods.prototypes import prototype_logits
from raycompat.models import ClassifierHead, ModelBundle, margin_logits
from raycompat.torch_distributed import shard_indices

# The checks read losses that carry a graph with float(); that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

# -- stand-ins shared with test_methods_distributed.py -------------------------------------
IN_DIM, D_OLD, D_NEW = 10, 6, 8
OLD_CLASSES = [0, 1, 2]  # catalog classes the old head knows (rows 0..2)
NEW_CLASSES = [0, 1, 2, 3, 4]  # new head rows 0..4 (catalog ids equal rows here)
BATCH_LABELS = [0, 0, 1, 3, 3, 4, 2, 1]  # global batch: two workers hold 4 each
TRAIN_LABELS = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]  # 11 items: shards of 6 and 5 on 2 workers


class TinyEmbedder(nn.Module):
    """phi(x) = Linear(flatten(x)): deterministic per sample (no BatchNorm)."""

    def __init__(self, in_dim: int, embed_dim: int):
        super().__init__()
        self.fc = nn.Linear(in_dim, embed_dim)
        self.embed_dim = embed_dim

    def forward(self, x):
        return self.fc(x.flatten(1))


def make_batch(labels, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor(labels)
    return TrainBatch(
        x_new=torch.randn(len(labels), IN_DIM, generator=g),
        labels=labels,
        new_targets=labels.clone(),
        x_old=torch.randn(len(labels), IN_DIM, generator=g),
        old_targets=torch.where(labels < len(OLD_CLASSES), labels, -1),
    )


def slice_batch(batch: TrainBatch, rows) -> TrainBatch:
    return TrainBatch(
        x_new=batch.x_new[rows],
        labels=batch.labels[rows],
        new_targets=batch.new_targets[rows],
        x_old=batch.x_old[rows],
        old_targets=batch.old_targets[rows],
    )


class ShardLoader:
    """The ``epoch_pass_loader`` contract: this worker's strided shard, no shuffle, no padding."""

    def __init__(self, batch: TrainBatch, batch_size: int = 4):
        self.batch, self.batch_size = batch, batch_size

    def __call__(self):
        rows = torch.from_numpy(shard_indices(len(self.batch.labels)))
        for start in range(0, len(rows), self.batch_size):
            yield slice_batch(self.batch, rows[start : start + self.batch_size])


def old_bundle(head: str = "cosface") -> ModelBundle:
    """The frozen old model: a linear embedder and a CosFace (or ``head``) head over OLD_CLASSES
    (seeded)."""
    torch.manual_seed(1)
    return ModelBundle(
        {
            "embedder": TinyEmbedder(IN_DIM, D_OLD),
            "head": ClassifierHead(D_OLD, len(OLD_CLASSES), kind=head),
        },
        {"classes": OLD_CLASSES},
    ).freeze()


def build(method: str, options=None, new_dim: int = D_NEW, head: str = "cosface") -> TrainingModule:
    """A TrainingModule of tiny stand-ins, identical in every process (seeded). With the fixed
    ``dsimplex`` head the old model has one too (every generation shares the simplex)."""
    old = old_bundle("dsimplex" if head == "dsimplex" else "cosface")
    with torch.no_grad():
        if head != "dsimplex":
            old.head.weight.normal_()  # well-spread old classifier rows
    context = MethodContext(
        old=old,
        new_classes=NEW_CLASSES,
        old_classes=OLD_CLASSES,
        compatible_dim=D_OLD,
        device=torch.device("cpu"),
        epoch_pass_loader=ShardLoader(make_batch(TRAIN_LABELS, seed=7)),
    )
    torch.manual_seed(2)
    embedder = TinyEmbedder(IN_DIM, new_dim)
    head_module = ClassifierHead(new_dim, len(NEW_CLASSES), kind=head)
    return TrainingModule(embedder, head_module, build_method(method, options, context))


def features(module: TrainingModule, batch: TrainBatch):
    emb = module.embedder(batch.x_new)
    return emb, module.method.old_features(batch.x_old)


# -- contrastive / ract ----------------------------------------------------------------------
def test_ract_logit_layout_and_masks():
    n = F.normalize(torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]]), dim=1)
    o = F.normalize(torch.tensor([[0.6, 0.8], [1.0, 0.0], [0.6, -0.8]]), dim=1)
    labels = torch.tensor([0, 0, 1])
    tau = 0.5
    logits = compatibility_logits(n, o, labels, tau, new_full=n)
    inf = float("-inf")
    s = lambda a, b: float(a @ b)  # noqa: E731
    expected = (
        torch.tensor(
            [
                [s(n[0], o[0]), inf, inf, s(n[0], o[2]), inf, inf, s(n[0], n[2])],
                [s(n[1], o[1]), inf, inf, s(n[1], o[2]), inf, inf, s(n[1], n[2])],
                [
                    s(n[2], o[2]),
                    s(n[2], o[0]),
                    s(n[2], o[1]),
                    inf,
                    s(n[2], n[0]),
                    s(n[2], n[1]),
                    inf,
                ],
            ]
        )
        / tau
    )
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    assert torch.allclose(logits[~torch.isinf(logits)], expected[~torch.isinf(expected)], atol=1e-6)
    vanilla = compatibility_logits(n, o, labels, tau)
    assert vanilla.shape == (3, 4) and torch.allclose(vanilla, logits[:, :4])


def _direct_contrastive(part, full, old, labels, tau, new_to_new):
    part, full, old = (F.normalize(t.detach(), dim=1) for t in (part, full, old))
    losses = []
    for i in range(len(labels)):
        pos = math.exp(float(part[i] @ old[i]) / tau)
        neg = 0.0
        for k in range(len(labels)):
            if labels[k] != labels[i]:
                neg += math.exp(float(part[i] @ old[k]) / tau)
                if new_to_new:
                    neg += math.exp(float(full[i] @ full[k]) / tau)
        losses.append(-math.log(pos / (pos + neg)))
    return sum(losses) / len(losses)


def _direct_triplet(part, full, old, labels, m, new_to_new):
    part, full, old = (F.normalize(t.detach(), dim=1) for t in (part, full, old))
    losses = []
    for i in range(len(labels)):
        pos = float(part[i] @ old[i])
        terms = []
        for k in range(len(labels)):
            if labels[k] != labels[i]:
                t = max(0.0, float(part[i] @ old[k]) - pos + m)
                if new_to_new:
                    t += max(0.0, float(full[i] @ full[k]) - pos + m)
                terms.append(t)
        losses.append(sum(terms) / len(terms) if terms else 0.0)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("method", ["contrastive", "ract"])
@pytest.mark.parametrize("form", ["contrastive", "triplet"])
def test_contrastive_and_ract_match_direct_computation(method, form):
    module = build(method, {"form": form, "tau": 0.1, "margin": 0.5})
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    got = module.method.compat_loss(module, batch, emb)["compat"]
    part = emb[:, :D_OLD]  # dimension change: the first D_old dims meet the old features
    if form == "contrastive":
        want = _direct_contrastive(part, emb, old, BATCH_LABELS, 0.1, method == "ract")
    else:
        want = _direct_triplet(part, emb, old, BATCH_LABELS, 0.5, method == "ract")
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_triplet_hinge_has_the_corrected_sign():
    # Positive pair perfectly aligned, the negative orthogonal: no loss with margin 0.5.
    n = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    o = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert torch.allclose(compatibility_triplet(n, o, torch.tensor([0, 1]), 0.5), torch.zeros(2))
    # Swapped old features: the negative is closer than the positive -> s_neg - s_pos + m = 1.5.
    swapped = compatibility_triplet(n, o.flip(0), torch.tensor([0, 1]), 0.5)
    assert torch.allclose(swapped, torch.full((2,), 1.5))


# -- l2 / bct ----------------------------------------------------------------------------------
def test_l2_is_half_squared_distance_and_needs_equal_dims():
    module = build("l2", new_dim=D_OLD)
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    got = module.method.compat_loss(module, batch, emb)["l2"]
    want = sum(0.5 * float(((emb[i] - old[i]) ** 2).sum()) for i in range(len(emb))) / len(emb)
    assert float(got) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ConfigError, match="embed_dim == the old model's"):
        build("l2", new_dim=D_NEW)


def test_bct_sys_synthesises_class_means_and_uses_them():
    module = build("bct", {"variant": "sys"})
    module.method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    with torch.no_grad():
        old_train = module.method.old.embedder(train.x_old)
    for j, c in enumerate([3, 4]):  # the classes the old head does not know, in row order
        mean = old_train[train.labels == c].mean(dim=0)
        assert torch.allclose(module.method.synth_rows[j], mean, atol=1e-6)
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, _ = features(module, batch)
    got = module.method.compat_loss(module, batch, emb)["influence"]
    head = module.method.old.head
    weight = torch.cat([head.weight, module.method.synth_rows])
    rows = torch.tensor([0, 0, 1, 3, 3, 4, 2, 1])  # classes 3, 4 -> synthesised rows 3, 4
    cos = F.normalize(emb[:, :D_OLD], dim=1) @ F.normalize(weight, dim=1).t()
    logits = 32 * cos
    logits[torch.arange(8), rows] -= 32 * 0.4  # the old head is CosFace
    assert float(got) == pytest.approx(float(F.cross_entropy(logits, rows)), rel=1e-5)


def test_bct_beta_and_kd_treat_unknown_classes():
    batch = make_batch(BATCH_LABELS, seed=3)
    known = batch.old_targets >= 0
    beta = build("bct", {"variant": "beta"})
    emb, old = features(beta, batch)
    head = beta.method.old.head
    logits = head(emb[known][:, :D_OLD], batch.old_targets[known])
    want = F.cross_entropy(logits, batch.old_targets[known])
    assert float(beta.method.compat_loss(beta, batch, emb)["influence"]) == pytest.approx(
        float(want), rel=1e-5
    )
    kd = build("bct", {"variant": "kd", "kd_scale": 10.0})
    terms = kd.method.compat_loss(kd, batch, emb)
    teacher = F.softmax(10 * head.cosine(old[~known]), dim=1)
    student = F.log_softmax(10 * head.cosine(emb[~known][:, :D_OLD]), dim=1)
    kl = (teacher * (teacher.log() - student)).sum(dim=1).sum() / len(batch.labels)
    assert float(terms["kd"]) == pytest.approx(float(kl), rel=1e-5)


# -- dmu ---------------------------------------------------------------------------------------
def test_dmu_weights_sum_to_one_and_favour_discriminative_samples():
    uncertainty = torch.tensor([0.1, 2.0, 0.5, 7.0])
    known = torch.tensor([True, True, False, True])
    w = selective_weights(uncertainty, known)
    sm = F.softmax(torch.tensor([0.1, 2.0, 7.0]), dim=0)
    assert torch.allclose(w[known], (1 - sm) / 2) and w[2] == 0
    assert float(w.sum()) == pytest.approx(1.0)
    assert w[0] > w[1] > w[3]  # lower entropy (more discriminative) -> more weight
    assert torch.equal(
        selective_weights(torch.tensor([3.0, 1.0]), torch.tensor([False, True])),
        torch.tensor([0.0, 1.0]),
    )


def test_dmu_discriminativeness_entropy_scale_and_least_confidence():
    cos = torch.tensor([[0.9, 0.1, 0.0], [0.3, 0.3, 0.3]])
    rows = torch.tensor([0, 2])
    p = F.softmax(30 * cos, dim=1)
    entropy = -(p * p.log()).sum(dim=1)
    assert torch.allclose(discriminativeness(cos, rows, "entropy", 30.0), entropy, atol=1e-6)
    # Without the scale every entropy is ~log C (the paper's Eq.9 as printed).
    assert torch.allclose(
        discriminativeness(cos, rows, "entropy", 1.0), torch.full((2,), math.log(3)), atol=0.2
    )
    assert torch.allclose(  # DMU Eq.13: Lambda = p_y
        discriminativeness(cos, rows, "least_confidence", 30.0), p[torch.arange(2), rows], atol=1e-6
    )


def test_dmu_sbc_uses_the_old_classifier_with_arcface():
    module = build("dmu", {"psi_hidden": 16, "arc_scale": 20.0, "arc_margin": 0.2}, head="arcface")
    module.method.psi.eval()
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, old = features(module, batch)
    terms = module.method.compat_loss(module, batch, emb)
    old_head = module.method.old.head
    known = batch.old_targets >= 0
    weights = selective_weights(
        discriminativeness(old_head.cosine(old), batch.old_targets, "entropy", 30.0), known
    )
    cos = F.normalize(emb[:, :D_OLD], dim=1) @ F.normalize(old_head.weight, dim=1).t()
    sbc = 0.0
    for i in torch.nonzero(known).flatten().tolist():
        logits = 20 * cos[i].clone()
        y = int(batch.old_targets[i])
        logits[y] = 20 * math.cos(math.acos(float(cos[i, y])) + 0.2)
        sbc += float(weights[i]) * float(F.cross_entropy(logits[None], torch.tensor([y])))
    assert float(terms["sbc"]) == pytest.approx(sbc, rel=1e-5)
    fa = F.cross_entropy(module.head(module.method.psi(old), batch.new_targets), batch.new_targets)
    assert float(terms["fa"]) == pytest.approx(float(fa), rel=1e-5)
    # The new classifier does not enter L_SBC; the old one does.
    with torch.no_grad():
        module.head.weight.mul_(-1)
    assert float(module.method.compat_loss(module, batch, emb)["sbc"]) == pytest.approx(
        sbc, rel=1e-5
    )
    with torch.no_grad():
        old_head.weight.mul_(-1)
    assert float(module.method.compat_loss(module, batch, emb)["sbc"]) != pytest.approx(
        sbc, rel=1e-3
    )
    assert set(module.method.exports()) == {"psi"}


# -- mcl / cl / rqt ------------------------------------------------------------------------------
def _d(a, b):
    return float(((F.normalize(a, dim=0) - F.normalize(b, dim=0)) ** 2).sum())


def test_mcl_symmetric_denominators_match_direct_computation():
    torch.manual_seed(0)
    labels = [0, 0, 1, 1, 2]
    new, rev, old = torch.randn(5, 4), torch.randn(5, 3), torch.randn(5, 3)
    module = build("mcl", {"psi_rev_blocks": 0})
    terms = module.method.rank_merge_loss(new, rev, old, torch.tensor(labels))
    old_sum = new_sum = printed_new = 0.0
    for i in range(5):
        p_old = sum(math.exp(-_d(rev[i], old[k])) for k in range(5) if labels[k] == labels[i])
        n_old = sum(math.exp(-_d(rev[i], old[k])) for k in range(5) if labels[k] != labels[i])
        p_new = sum(
            math.exp(-_d(new[i], new[k])) for k in range(5) if labels[k] == labels[i] and k != i
        )
        n_new = sum(math.exp(-_d(new[i], new[k])) for k in range(5) if labels[k] != labels[i])
        old_sum += -math.log(p_old / (p_old + n_old + n_new))
        if p_new > 0:  # anchor 4 has no other sample of its class: no new-system term
            new_sum += -math.log(p_new / (p_new + n_new + n_old))
            printed_new += -math.log(p_new / (p_new + n_new + n_new))
    assert float(terms["mcl_old"]) == pytest.approx(old_sum / 5, rel=1e-5)
    assert float(terms["mcl_new"]) == pytest.approx(new_sum / 4, rel=1e-5)
    assert float(terms["mcl_new"]) != pytest.approx(printed_new / 4, rel=1e-3)


def test_cl_and_rqt_match_direct_computation():
    torch.manual_seed(0)
    labels = [0, 1, 0, 1]
    new, rev, old = torch.randn(4, 8), torch.randn(4, 6), torch.randn(4, 6)
    cl = build("cl", {"temperature": 0.5, "psi_rev_blocks": 0}).method
    want = 0.0
    for i in range(4):
        s = [math.exp(-_d(rev[i], old[k]) / 0.5) for k in range(4)]
        p = sum(s[k] for k in range(4) if labels[k] == labels[i])
        want += -math.log(p / sum(s))
    assert float(cl.rank_merge_loss(new, rev, old, torch.tensor(labels))["cl"]) == pytest.approx(
        want / 4, rel=1e-5
    )
    rqt = build("rqt", {"distance": "cosine", "psi_rev_blocks": 0}).method
    want = (
        sum(1 - float(F.normalize(rev[i], dim=0) @ F.normalize(old[i], dim=0)) for i in range(4))
        / 4
    )
    assert float(rqt.rank_merge_loss(new, rev, old, torch.tensor(labels))["rqt"]) == pytest.approx(
        want, rel=1e-5
    )


def test_hard_mining_keeps_the_hardest_half():
    d = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7]])
    pos = torch.tensor([[True, True, True, False, False]])
    neg = ~pos
    assert hardest_half(d, pos, largest=True).tolist() == [[False, True, True, False, False]]
    assert hardest_half(d, neg, largest=False).tolist() == [[False, False, False, True, False]]


def test_rank_merge_methods_freeze_the_new_model_and_train_rho_psi_rev_only():
    batch = make_batch(BATCH_LABELS, seed=3)
    for name in ("mcl", "cl", "rqt"):
        module = build(name, {"psi_rev_hidden": 16})
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        assert trainable and all(
            n.startswith("method.psi_rev") or n.startswith("method.rho") for n in trainable
        ), trainable
        assert any(n.startswith("method.rho") for n in trainable) == (name == "mcl")
        assert set(module.method.exports()) == {"rho", "psi_rev"}
        terms = module(batch)
        assert "cls" not in terms and torch.isfinite(terms["loss"])
        # rho starts as the identity: rho(phi_n(x)) == phi_n(x)
        with torch.no_grad():
            feat = module.embedder(batch.x_new)
            assert torch.allclose(module.method.rho(feat), feat, atol=1e-6)


# -- p2s / ndpp / odpp ---------------------------------------------------------------------------
def test_p2s_logits_and_prototypes_over_every_new_class():
    module = build("p2s", {"tau": 0.5})
    module.method.on_epoch_start(0, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    with torch.no_grad():
        old_train = F.normalize(module.method.old.embedder(train.x_old), dim=1)
    protos = torch.stack([old_train[train.labels == c].mean(dim=0) for c in NEW_CLASSES])
    assert torch.allclose(module.method.old_prototypes, protos, atol=1e-6)  # classes 3, 4 included
    batch = make_batch(BATCH_LABELS, seed=3)
    emb, _ = features(module, batch)
    logits = F.normalize(emb[:, :D_OLD], dim=1) @ F.normalize(protos, dim=1).t() / 0.5
    want = F.cross_entropy(logits, batch.new_targets)
    assert float(module.method.compat_loss(module, batch, emb)["p2s"]) == pytest.approx(
        float(want), rel=1e-5
    )


def test_prototype_logits_perturb_the_positive_column_only():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    negatives = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    positives = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    logits = prototype_logits(e, torch.tensor([0, 1]), negatives, 1.0, positives)
    r = 1 / math.sqrt(2)
    assert torch.allclose(logits, torch.tensor([[r, 0.0, r], [0.0, 1.0, r]]), atol=1e-6)


def test_ndpp_repulsion_excludes_self_and_same_class_new_prototype():
    old = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    eye = torch.eye(3, dtype=torch.bool)
    r = neighbour_repulsion(old, old, 1, eye)
    # K=1: the nearest *other* prototype; the weight cancels: r^c = p^c - p^nn(c).
    assert torch.allclose(
        r.float(), torch.stack([old[0] - old[1], old[1] - old[0], old[2] - old[1]]), atol=1e-6
    )
    # K=2, weights = cosines: r^0 = (0.8 (p0 - p1) + 0 (p0 - p2)) / 0.8
    r2 = neighbour_repulsion(old, old, 2, eye)
    assert torch.allclose(r2[0].float(), old[0] - old[1], atol=1e-6)
    # New prototypes equal to the old ones: the same-class one (the nearest) must be skipped.
    p_hat = ndpp_prototypes(old, old.clone(), alpha_old=0.1, alpha_new=0.2, k=1)
    first = old + 0.1 * torch.stack([old[0] - old[1], old[1] - old[0], old[2] - old[1]])
    second = neighbour_repulsion(first, old, 1, eye).float()
    assert torch.allclose(p_hat, first + 0.2 * second, atol=1e-6)
    assert torch.allclose(second[2], first[2] - old[1], atol=1e-6)  # not first[2] - old[2]


def test_ndpp_rebuilds_pseudo_prototypes_each_epoch_not_cumulatively():
    module = build("ndpp", {"alpha_old": 0.5, "alpha_new": 0.5, "k": 2})
    method = module.method
    method.on_epoch_start(0, module)
    first = method.pseudo_prototypes.clone()
    method.on_epoch_start(1, module)  # same phi_n -> same prototypes, not added twice
    assert torch.allclose(method.pseudo_prototypes, first)
    with torch.no_grad():
        module.embedder.fc.weight.add_(1.0)
    method.on_epoch_start(2, module)  # phi_n changed -> r_t changed
    assert not torch.allclose(method.pseudo_prototypes, first)
    new = torch.zeros(5, D_OLD)
    assert not torch.allclose(first, method.old_prototypes)
    assert torch.allclose(
        ndpp_prototypes(method.old_prototypes, None, 0.5, 0.0, 2),
        ndpp_prototypes(method.old_prototypes, new, 0.5, 0.0, 2),
    )


def test_odpp_hinge_gradient():
    p_old = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]], dtype=torch.float64)
    p_new = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    r = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    pairs = torch.tensor([[0, 1], [2, 0]])
    loss = perturbation_objective(p_old, r, p_new, pairs, theta_old=0.6, theta_new=0.6, gamma=2.0)
    loss.backward()
    # pair (0,1): p0.p1 = 0.9 > 0.6 active -> d/dr0 = p1, d/dr1 = p0;
    #             p0.pn1 = 1.0 > 0.6 -> d/dr0 += 2*pn1
    # pair (2,0): p2.p0 = 0 inactive; p2.pn0 = 0.5 < 0.6 inactive.
    expected = torch.zeros(3, 2, dtype=torch.float64)
    expected[0] = p_old[1] + 2 * p_new[1]
    expected[1] = p_old[0]
    assert torch.allclose(r.grad, expected)
    assert float(loss) == pytest.approx((0.9 - 0.6) + 2 * (1.0 - 0.6))


def test_odpp_optimisation_is_seeded_and_reduces_the_objective():
    torch.manual_seed(0)
    p_old = F.normalize(torch.randn(6, 4) + 2.0, dim=1).double()
    p_new = F.normalize(torch.randn(6, 4) + 2.0, dim=1).double()
    kwargs = dict(
        theta_old=0.6,
        theta_new=0.6,
        gamma=1.0,
        lr=0.01,
        epochs=20,
        pairs_per_epoch=64,
        batch_pairs=16,
        seed=5,
    )
    r0 = torch.zeros(6, 4, dtype=torch.float64)
    r1 = optimise_perturbation(p_old, p_new, r0, **kwargs)
    assert torch.equal(r1, optimise_perturbation(p_old, p_new, r0, **kwargs))
    assert not torch.equal(r1, optimise_perturbation(p_old, p_new, r0, **{**kwargs, "seed": 6}))
    pairs = torch.tensor([(a, b) for a in range(6) for b in range(6) if a != b])
    before = perturbation_objective(p_old, r0, p_new, pairs, 0.6, 0.6, 1.0)
    after = perturbation_objective(p_old, r1, p_new, pairs, 0.6, 0.6, 1.0)
    assert float(after) < 0.5 * float(before)
    drawn = random_pairs(3, 500, torch.Generator().manual_seed(0))
    assert (drawn[:, 0] != drawn[:, 1]).all() and set(drawn.flatten().tolist()) == {0, 1, 2}


def test_odpp_uses_perturbed_positives_and_warm_starts():
    module = build(
        "odpp", {"theta_old": 0.0, "theta_new": 0.0, "perturb_lr": 0.05, "perturb_epochs": 3}
    )
    method = module.method
    method.on_epoch_start(0, module)
    r0 = method.perturbation.clone()
    assert r0.abs().sum() > 0 and method.num_images == len(TRAIN_LABELS)
    assert torch.allclose(method.positive_prototypes(), method.old_prototypes + r0)
    method.on_epoch_start(1, module)
    train = make_batch(TRAIN_LABELS, seed=7)
    with torch.no_grad():
        feats = F.normalize(module.embedder(train.x_new)[:, :D_OLD], dim=1)
    new = torch.stack([feats[train.labels == c].mean(dim=0) for c in NEW_CLASSES])
    kwargs = dict(
        theta_old=0.0,
        theta_new=0.0,
        gamma=1.0,
        lr=0.05,
        epochs=3,
        pairs_per_epoch=11,
        batch_pairs=1024,
        seed=1,
    )  # seed = options.seed * 1000003 + epoch
    warm = optimise_perturbation(method.old_prototypes, new, r0, **kwargs)
    cold = optimise_perturbation(method.old_prototypes, new, torch.zeros_like(r0), **kwargs)
    assert torch.allclose(method.perturbation, warm, atol=1e-6)
    assert not torch.allclose(warm, cold, atol=1e-4)


# -- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,options,match",
    [
        ("ract", {"tau": 0}, "'tau' = 0.0 must be >= "),
        (
            "ract",
            {"form": "hinge"},
            r"'form' = 'hinge' is not allowed; allowed values: \['contrastive', 'triplet'\]",
        ),
        (
            "dmu",
            {"discriminativeness": "margin"},
            r"allowed values: \['entropy', 'least_confidence'\]",
        ),
        ("mcl", {"distance": "l1"}, r"allowed values: \['squared_l2', 'l2', 'cosine'\]"),
        ("ndpp", {"k": 0}, "'k' = 0 must be >= 1"),
        ("odpp", {"gamma": -1}, "'gamma' = -1.0 must be >= 0"),
        (
            "p2s",
            {"temperature": 1},
            r"unknown option 'temperature'; allowed options: \['lambda_compat', 'tau'\]",
        ),
        ("mcl", {"hard_mining": "maybe"}, "hard_mining' must be true or false"),
    ],
)
def test_bad_options_name_the_key_and_allowed_values(method, options, match):
    with pytest.raises(ConfigError, match=match):
        parse_method_options(method, options)


def test_dmu_least_confidence_is_eq13_softmax_of_p_y():
    """Eq.13: Lambda = p_y and lambda = softmax_B(Lambda), not the entropy form."""
    g = torch.Generator().manual_seed(0)
    cos = torch.rand(64, 5, generator=g) * 2 - 1
    rows = torch.randint(0, 5, (64,), generator=g)
    known = torch.ones(64, dtype=torch.bool)
    p_y = F.softmax(30.0 * cos, dim=1)[torch.arange(64), rows]
    lam = discriminativeness(cos, rows, "least_confidence", 30.0)
    assert torch.allclose(lam, p_y, atol=1e-6)
    w = selective_weights(lam, known, "least_confidence")
    direct = torch.exp(p_y) / torch.exp(p_y).sum()
    assert torch.allclose(w, direct, atol=1e-7) and float(w.sum()) == pytest.approx(1.0)
    assert float(w.max() / w.min()) > 2.0  # Eq.13 spreads the weights (e^1 at most)
    assert int(w.argmax()) == int(p_y.argmax())  # the most confident sample weighs most


def test_dmu_open_class_has_a_compatibility_loss_through_synthesised_rows():
    """New training classes unknown to the old classifier: DMU appends their synthesised rows
    (class means of phi_o, as BCT-sys), so L_SBC is not zero and equals the direct computation
    with the extended classifier."""
    old = old_bundle()
    g = torch.Generator().manual_seed(7)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])  # new-head rows of classes 10, 11, 12
    train = TrainBatch(
        x_new=torch.randn(8, IN_DIM, generator=g),
        labels=labels,
        new_targets=labels.clone(),
        x_old=torch.randn(8, IN_DIM, generator=g),
        old_targets=torch.full((8,), -1),
    )
    context = MethodContext(
        old=old,
        new_classes=[10, 11, 12],
        old_classes=OLD_CLASSES,
        compatible_dim=D_OLD,
        device=torch.device("cpu"),
        epoch_pass_loader=ShardLoader(train),
    )
    torch.manual_seed(2)
    module = TrainingModule(
        TinyEmbedder(IN_DIM, D_NEW),
        ClassifierHead(D_NEW, 3, kind="arcface"),
        build_method("dmu", {"psi_hidden": 16}, context),
    )
    module.method.psi.eval()
    emb = module.embedder(train.x_new)
    assert float(module.method.compat_loss(module, train, emb)["sbc"]) == 0.0  # no rows yet
    module.method.on_epoch_start(0, module)
    old_feat = old.embedder(train.x_old)
    means = torch.stack([old_feat[labels == c].mean(0) for c in range(3)])
    assert torch.allclose(module.method.synth_rows, means, atol=1e-6)
    sbc = float(module.method.compat_loss(module, train, emb)["sbc"])
    weight = torch.cat([old.head.weight, means])
    rows = labels + len(OLD_CLASSES)
    lam = discriminativeness(old.head.cosine(old_feat, weight), rows, "entropy", 30.0)
    w = selective_weights(lam, torch.ones(8, dtype=torch.bool))
    logits = margin_logits(old.head.cosine(emb[:, :D_OLD], weight), rows, "arcface", 30.0, 0.3)
    direct = float((w * F.cross_entropy(logits, rows, reduction="none")).sum())
    assert sbc > 0 and sbc == pytest.approx(direct, rel=1e-5)
