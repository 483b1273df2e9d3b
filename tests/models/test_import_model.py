"""``raycompat import-model``: a timm checkpoint or a TorchScript file becomes a head-less model
bundle that embeds exactly as the original model and that BCT trains against (no Ray)."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError
from raycompat.import_model import main
from raycompat.methods import MethodContext, TrainBatch, TrainingModule, build_method, method_class
from raycompat.models import ClassifierHead, Embedder, ModelBundle

RES = 32
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad"),
]


class SmallNet(nn.Module):
    """A user's model: conv -> mean pool -> linear to 12 dims."""

    def __init__(self, in_chans: int = 3, dim: int = 12):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3)
        self.fc = nn.Linear(8, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def pixels(n: int = 3, chans: int = 3, seed: int = 0) -> torch.Tensor:
    """A batch as the pipeline feeds it: pixels in [-1, 1]."""
    return torch.rand(n, chans, RES, RES, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def run(capsys, command: str) -> tuple[int, str]:
    """``raycompat import-model <command>``: exit status and everything printed."""
    rc = main(shlex.split(command))
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def scripted_file(tmp_path, trace: bool = False) -> tuple[str, torch.jit.ScriptModule]:
    torch.manual_seed(0)
    net = SmallNet().eval()
    module = torch.jit.trace(net, pixels()) if trace else torch.jit.script(net)
    path = str(tmp_path / ("traced.pt" if trace else "scripted.pt"))
    torch.jit.save(module, path)
    return path, module


def test_raycompat_embedder_checkpoint_round_trip(tmp_path, capsys):
    torch.manual_seed(0)
    source = Embedder("resnet10t", 16, in_chans=3).eval()
    ckpt = tmp_path / "old.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, ckpt)
    out = tmp_path / "bundle"
    rc, text = run(
        capsys,
        f"--timm resnet10t --checkpoint {ckpt} --embed-dim 16 --resolution {RES} --out {out}",
    )
    assert rc == 0, text
    assert "no classifier head" in text
    bundle = ModelBundle.load(str(out))
    assert not bundle.has_head and bundle.classes == [] and bundle.embed_dim == 16
    manifest = bundle.manifest
    assert manifest["method"] == "imported" and manifest["resolution"] == RES
    assert manifest["imported"]["form"] == "embedder"
    x = pixels()
    with torch.no_grad():
        assert torch.allclose(bundle.embedder(x), source(x), atol=1e-5)


def test_plain_timm_checkpoint_drops_its_classifier(tmp_path, capsys):
    torch.manual_seed(0)
    source = timm.create_model("resnet10t", pretrained=False, num_classes=7).eval()
    ckpt = tmp_path / "timm.pth"
    torch.save({"model": source.state_dict(), "epoch": 3}, ckpt)
    out = tmp_path / "bundle"
    rc, text = run(
        capsys,
        f"--timm resnet10t --checkpoint {ckpt} --embed-dim 512 --resolution {RES} "
        f"--input-norm imagenet --out {out}",
    )
    assert rc == 0, text
    bundle = ModelBundle.load(str(out))
    assert bundle.manifest["imported"]["form"] == "timm"
    x = pixels()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        want = source.forward_head(source.forward_features(((x + 1) / 2 - mean) / std), True)
        assert torch.allclose(bundle.embedder(x), want, atol=1e-5)


@pytest.mark.parametrize("trace", [False, True])
def test_torchscript_round_trip(tmp_path, capsys, trace):
    path, module = scripted_file(tmp_path, trace)
    out = tmp_path / "bundle"
    rc, text = run(capsys, f"--torchscript {path} --embed-dim 12 --resolution {RES} --out {out}")
    assert rc == 0, text
    os.remove(path)  # the bundle holds its own copy
    assert "embedder.torchscript.pt" in os.listdir(out)
    bundle = ModelBundle.load(str(out))
    assert bundle.embedder.spec["type"] == "torchscript" and bundle.embed_dim == 12
    x = pixels(seed=1)
    with torch.no_grad():
        assert torch.allclose(bundle.embedder(x), module(x), atol=1e-6)
    unit = tmp_path / "unit"
    copy = out / "embedder.torchscript.pt"
    rc, text = run(
        capsys,
        f"--torchscript {copy} --embed-dim 12 --resolution {RES} --input-norm unit --out {unit}",
    )
    assert rc == 0, text
    with torch.no_grad():
        got = ModelBundle.load(str(unit)).embedder(x)
        assert torch.allclose(got, module((x + 1) / 2), atol=1e-6)


def test_bad_inputs_exit_2_naming_what_is_wrong(tmp_path, capsys):
    script, _ = scripted_file(tmp_path)
    torch.manual_seed(0)
    ckpt = tmp_path / "old.pth"
    torch.save(Embedder("resnet10t", 16, in_chans=3).state_dict(), ckpt)
    out = tmp_path / "b"
    common = f"--resolution {RES} --out {out}"
    cases = [
        (f"--torchscript {tmp_path / 'gone.pt'} --embed-dim 12", "gone.pt': no such file"),
        (
            f"--timm resnet10t --checkpoint {tmp_path / 'gone.pth'} --embed-dim 16",
            "gone.pth': no such file",
        ),
        (
            f"--torchscript {script} --embed-dim 64",
            "gives output [2, 12] for a batch of 2, but --embed-dim 64 needs [2, 64]",
        ),
        (
            f"--timm resnet10t --checkpoint {ckpt} --embed-dim 32",
            "--embed-dim 32 does not match the checkpoint",
        ),
        (f"--timm resnet18 --checkpoint {ckpt} --embed-dim 16", "missing keys"),
        (
            f"--timm resnet10t --checkpoint {ckpt} --embed-dim 16 --in-chans 1",
            "has shape [24, 3, 3, 3]",
        ),
        (f"--timm resnet10t --checkpoint {script} --embed-dim 16", "--torchscript"),
    ]
    for args, message in cases:
        rc, text = run(capsys, f"{args} {common}")
        assert rc == 2 and message in text and "Traceback" not in text, (args, text)
    assert not os.path.exists(out)
    good = f"--torchscript {script} --embed-dim 12"
    assert run(capsys, f"{good} {common}")[0] == 0
    rc, text = run(capsys, f"{good} {common}")
    assert rc == 2 and f"--out '{out}' already exists; pass --overwrite" in text
    assert run(capsys, f"{good} {common} --overwrite")[0] == 0
    rc, text = run(capsys, f"{good} --resolution {RES} --out {script} --overwrite")
    assert rc == 2 and "is not a model bundle; not replacing it" in text


# -- BCT against a head-less imported old model ----------------------------------------------
NEW_CLASSES = [0, 1, 2]
TRAIN_LABELS = [0, 1, 2, 0, 1, 2, 0, 1]


def headless_context(tmp_path, capsys) -> MethodContext:
    script, _ = scripted_file(tmp_path)
    out = tmp_path / "old"
    rc, text = run(capsys, f"--torchscript {script} --embed-dim 12 --resolution {RES} --out {out}")
    assert rc == 0, text
    old = ModelBundle.load(str(out)).freeze()
    train = make_batch(TRAIN_LABELS, seed=5)
    return MethodContext(
        old=old,
        new_classes=NEW_CLASSES,
        old_classes=old.classes,
        compatible_dim=old.embed_dim,
        device=torch.device("cpu"),
        epoch_pass_loader=lambda: iter([train]),
    )


def make_batch(labels, seed: int) -> TrainBatch:
    labels = torch.tensor(labels)
    return TrainBatch(
        x_new=pixels(len(labels), seed=seed),
        labels=labels,
        new_targets=labels.clone(),
        x_old=pixels(len(labels), seed=seed + 100),
        old_targets=torch.full_like(labels, -1),
    )


def test_bct_sys_trains_against_a_headless_imported_model(tmp_path, capsys):
    context = headless_context(tmp_path, capsys)
    with pytest.raises(ConfigError, match="has no classifier head"):
        _ = context.old.head
    torch.manual_seed(0)
    model = TrainingModule(
        Embedder("resnet10t", 16, in_chans=3),
        ClassifierHead(16, len(NEW_CLASSES)),
        build_method("bct", {}, context),
    )
    model.method.on_epoch_start(0, model)
    train = make_batch(TRAIN_LABELS, seed=5)
    with torch.no_grad():
        old_train = context.old.embedder(train.x_old)
    means = torch.stack([old_train[train.labels == c].mean(0) for c in NEW_CLASSES])
    assert torch.allclose(model.method.synth_rows, means, atol=1e-5)
    batch = make_batch([2, 0, 1, 1], seed=9)
    model.eval()
    emb = model.embedder(batch.x_new)
    got = model.method.compat_loss(model, batch, emb)["influence"]
    cos = F.normalize(emb[:, :12], dim=1) @ F.normalize(means, dim=1).t()
    logits = 32 * cos
    logits[torch.arange(4), batch.new_targets] -= 32 * 0.4  # CosFace over synthesised rows
    assert float(got) == pytest.approx(float(F.cross_entropy(logits, batch.new_targets)), 1e-4)
    model.train()
    model(batch)["loss"].backward()
    assert model.embedder.fc.weight.grad.abs().sum() > 0


def test_bct_variants_needing_the_old_head_are_refused(tmp_path, capsys):
    context = headless_context(tmp_path, capsys)
    for variant in ("beta", "kd"):
        with pytest.raises(ConfigError, match="has none .an imported model.; use variant=sys"):
            build_method("bct", {"variant": variant}, context)
    with open(tmp_path / "old" / "manifest.json") as fh:
        manifest = json.load(fh)

    class Cfg:
        method_options = {"variant": "beta"}
        old_model = str(tmp_path / "old")

    with pytest.raises(ConfigError, match="variant 'beta' needs the old model's classifier"):
        method_class("bct").check_config(Cfg, manifest)
    Cfg.method_options = {}
    method_class("bct").check_config(Cfg, manifest)  # sys: allowed
