"""Embedder, heads, psi and bundles: direct computations on small tensors."""

from __future__ import annotations

import json
import math
import os

import pytest
import timm
import torch
import torch.nn.functional as F

from raycompat.models import ClassifierHead, Embedder, GeM, ModelBundle, PsiMLP, margin_logits


def test_gem_matches_formula():
    x = torch.rand(2, 3, 4, 4) + 0.1
    expected = x.pow(3).mean(dim=(2, 3)).pow(1 / 3)
    assert torch.allclose(GeM(3.0)(x), expected, atol=1e-6)


def test_embedder_shapes_and_normalised_embedding():
    torch.manual_seed(0)
    model = Embedder("test_resnet", 24, in_chans=1).eval()
    x = torch.randn(3, 1, 32, 32)
    assert model(x).shape == (3, 24)
    assert torch.allclose(model.embed(x).norm(dim=1), torch.ones(3), atol=1e-5)


def test_unknown_backbone_is_named():
    with pytest.raises(ValueError, match="unknown timm backbone 'resnet_does_not_exist'"):
        Embedder("resnet_does_not_exist", 8)


def test_pretrained_weights_only_from_local_path(tmp_path):
    source = timm.create_model("test_resnet", num_classes=0, global_pool="", in_chans=1)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    model = Embedder("test_resnet", 8, in_chans=1, pretrained_path=str(path))
    for (name, a), (_, b) in zip(
        source.state_dict().items(), model.backbone.state_dict().items(), strict=False
    ):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        Embedder("test_resnet", 8, pretrained_path=str(tmp_path / "missing.pth"))


def test_cosface_and_arcface_margins_on_target_only():
    cos = torch.tensor([[0.5, 0.2, -0.1], [0.1, 0.9, 0.3]])
    labels = torch.tensor([0, 1])
    cf = margin_logits(cos, labels, "cosface", scale=32.0, margin=0.4)
    assert torch.allclose(cf, 32 * torch.tensor([[0.1, 0.2, -0.1], [0.1, 0.5, 0.3]]), atol=1e-5)
    af = margin_logits(cos, labels, "arcface", scale=30.0, margin=0.3)
    expected = cos.clone()
    expected[0, 0] = math.cos(math.acos(0.5) + 0.3)
    expected[1, 1] = math.cos(math.acos(0.9) + 0.3)
    assert torch.allclose(af, 30 * expected, atol=1e-4)
    # label -1 (class unknown to the head): no margin anywhere
    none = margin_logits(cos, torch.tensor([-1, -1]), "cosface", scale=32.0, margin=0.4)
    assert torch.allclose(none, 32 * cos)


def test_head_softmax_and_cosine_logits():
    head = ClassifierHead(4, 3, kind="softmax")
    emb = torch.randn(2, 4)
    assert torch.allclose(head(emb), emb @ head.weight.T + head.bias, atol=1e-6)
    cos_head = ClassifierHead(4, 3, kind="cosface")
    expected = F.normalize(emb, dim=1) @ F.normalize(cos_head.weight, dim=1).T
    assert torch.allclose(cos_head.cosine(emb), expected, atol=1e-6)
    with pytest.raises(ValueError, match="unknown head 'sphereface'"):
        ClassifierHead(4, 3, kind="sphereface")


def test_psi_is_three_linear_bn_relu_blocks_plus_linear():
    psi = PsiMLP(16, 32, hidden_dim=64)
    kinds = [type(m).__name__ for m in psi.net]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU"] * 3 + ["Linear"]
    assert psi(torch.randn(5, 16)).shape == (5, 32)


def test_bundle_round_trip_with_manifest(tmp_path):
    torch.manual_seed(0)
    bundle = ModelBundle(
        {
            "embedder": Embedder("test_resnet", 12, in_chans=1),
            "head": ClassifierHead(12, 5, kind="arcface"),
            "psi": PsiMLP(12, 12, hidden_dim=32),
        },
        {"method": "dmu", "classes": [3, 5, 7, 9, 11], "compatible_dim": 12},
    )
    bundle.eval()
    path = bundle.save(str(tmp_path / "model"))
    manifest = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert manifest["method"] == "dmu"
    assert manifest["modules"]["embedder"]["backbone"] == "test_resnet"
    assert set(os.listdir(path)) == {"manifest.json", "embedder.pt", "head.pt", "psi.pt"}
    loaded = ModelBundle.load(path)
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(bundle.embedder(x), loaded.embedder(x))
        feats = torch.randn(4, 12)
        assert torch.equal(bundle.modules["psi"](feats), loaded.modules["psi"](feats))
    assert loaded.classes == [3, 5, 7, 9, 11]
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        ModelBundle.load(str(tmp_path / "nothing"))


def test_backbone_layers_unused_by_features_are_frozen():
    """LCNet keeps a conv_head that forward_features never uses: DDP needs it frozen."""
    model = Embedder("lcnet_050", 8, in_chans=1)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["backbone.conv_head.weight", "backbone.conv_head.bias"]
    model(torch.randn(2, 1, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_every_bundle_records_the_installed_version(tmp_path):
    """``raycompat.__version__`` is the installed distribution's version (its metadata), and a
    saved bundle's manifest records it: it reads back from disk."""
    from importlib.metadata import version

    import raycompat

    assert raycompat.__version__ == version("raycompat") and raycompat.__version__ != "0"
    path = ModelBundle({"embedder": Embedder("test_resnet", 8, in_chans=1)}, {}).save(
        str(tmp_path / "bundle")
    )
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["versions"]["raycompat"] == raycompat.__version__
    assert ModelBundle.load(path).manifest["versions"]["raycompat"] == raycompat.__version__
