"""A tiny Vision Transformer on scikit-learn's bundled 8x8 digits (shipped inside the package: no download).

The attention is written out with ``@`` and ``F.softmax`` so that every operator class the opkit taxonomy knows
appears as a functional call as well as a module: conv (patch embedding), norm, matmul, softmax, activation, loss.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy


class Attention(nn.Module):
    """Multi-head self-attention from matmuls and a softmax."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A Vision Transformer for 1x8x8 images: 2x2 patches, mean pooling, a linear head."""

    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: int = 2, patch: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(1, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (8 // patch) ** 2, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


class ViTClassifier(pl.LightningModule):
    """Train :class:`TinyViT` with AdamW and a cosine schedule, logging loss and accuracy.

    Args:
        dim: embedding width.
        depth: number of transformer blocks.
        heads: attention heads.
        mlp_ratio: MLP hidden width over ``dim``.
        lr: peak learning rate.

    Example:
        >>> model = ViTClassifier(dim=32, depth=2)
    """

    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyViT(dim, depth, heads, mlp_ratio)
        self.train_acc = MulticlassAccuracy(num_classes=10)
        self.val_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits.detach(), labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)
        if self.trainer is None or not self.trainer.estimated_stepping_batches:
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as ``(N, 1, 8, 8)`` floats in [0, 1] and int64 labels.

    Example:
        >>> images, labels = load_digits_tensors()
        >>> tuple(images.shape), int(labels.max())
        ((1797, 1, 8, 8), 9)
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.long)


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's bundled digits, split into train and validation with a fixed seed.

    Args:
        batch_size: samples per batch.
        val_fraction: share of samples held out for validation.
        num_workers: DataLoader workers.

    Example:
        >>> dm = DigitsDataModule(batch_size=32)
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, num_workers: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"Expected `val_fraction` in (0, 1), but got {val_fraction!r}")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers

    def setup(self, stage: str) -> None:
        dataset = TensorDataset(*load_digits_tensors())
        n_val = int(len(dataset) * self.val_fraction)
        self.train_set, self.val_set = random_split(
            dataset, [len(dataset) - n_val, n_val], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
