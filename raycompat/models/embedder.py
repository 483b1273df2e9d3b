"""Embedder = any timm backbone + GeM pooling + FC to D dimensions (docs/methods.md, Notation).

Retrieval uses the L2-normalised output; training losses receive the raw FC output and
normalise where their equation says so.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


class GeM(nn.Module):
    """Generalised-mean pooling, p=3 by default (Radenovic et al.; used by every seed paper)."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6, learnable: bool = False):
        super().__init__()
        p_tensor = torch.tensor(float(p))
        if learnable:
            self.p = nn.Parameter(p_tensor)
        else:
            self.register_buffer("p", p_tensor)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] feature map -> [B, C]."""
        return x.clamp(min=self.eps).pow(self.p).mean(dim=(-2, -1)).pow(1.0 / self.p)


class Embedder(nn.Module):
    """phi(x): timm backbone (by name) -> GeM -> Linear(C, embed_dim).

    Pretrained backbone weights are read from a local file only (``pretrained_path``);
    nothing is ever downloaded.
    """

    def __init__(
        self,
        backbone: str,
        embed_dim: int,
        in_chans: int = 1,
        gem_p: float = 3.0,
        pretrained_path: str | None = None,
    ):
        super().__init__()
        # imported here: timm pulls in torchvision and torch._dynamo (seconds of CPU in every
        # Ray worker, Serve replica and job process that only reads vectors or manifests)
        import timm

        if backbone not in timm.list_models():
            close = timm.list_models(f"*{backbone.split('_')[0]}*")[:10]
            raise ValueError(f"unknown timm backbone {backbone!r}; similar names: {close}")
        if pretrained_path is not None and not os.path.isfile(pretrained_path):
            raise FileNotFoundError(f"pretrained weights not found: {pretrained_path}")
        kwargs = dict(num_classes=0, global_pool="", in_chans=in_chans)
        if pretrained_path is not None:
            kwargs.update(pretrained=True, pretrained_cfg_overlay=dict(file=pretrained_path))
        self.backbone = timm.create_model(backbone, **kwargs)
        self._freeze_unused_backbone_parameters(in_chans)
        self.pool = GeM(gem_p)
        self.fc = nn.Linear(self.backbone.num_features, embed_dim)
        self.embed_dim = embed_dim
        self.spec = dict(
            type="embedder", backbone=backbone, embed_dim=embed_dim, in_chans=in_chans, gem_p=gem_p
        )

    def _freeze_unused_backbone_parameters(self, in_chans: int) -> None:
        """Some timm models keep head layers (e.g. LCNet/MobileNetV3 ``conv_head``) that
        ``forward_features`` never uses; DDP would wait forever for their gradients, so they
        are found with one dummy backward pass and frozen."""
        size = self.backbone.pretrained_cfg.get("input_size", (in_chans, 224, 224))[-2:]
        x = torch.zeros(2, in_chans, *size)
        was_training = self.backbone.training
        self.backbone.eval()
        with torch.enable_grad():  # also when the model is built inside torch.no_grad()
            self.backbone.forward_features(x).float().sum().backward()
        for p in self.backbone.parameters():
            if p.requires_grad and p.grad is None:
                p.requires_grad_(False)
            p.grad = None
        self.backbone.train(was_training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.backbone.forward_features(x)
        if feats.ndim == 3:  # token sequence (ViT-style): [B, N, C] -> [B, C, N, 1]
            feats = feats.transpose(1, 2).unsqueeze(-1)
        return self.fc(self.pool(feats))

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised retrieval embedding."""
        return F.normalize(self.forward(x), dim=-1)
