"""Tiny real models for the tests, and a reader for TensorBoard event files."""

from __future__ import annotations

import glob
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_loader(n: int = 64, batch_size: int = 8, dim: int = 8, classes: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Poison(nn.Module):
    """Identity, except that at chosen global steps it writes NaN/Inf into its output."""

    def __init__(self, steps: tuple[int, ...] = (), value: float = float("nan")) -> None:
        super().__init__()
        self.steps = set(steps)
        self.value = value
        self.step = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step in self.steps:
            x = x.clone()
            x[0, 0] = self.value
        return x


class _BadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # The whole gradient, not one column: a ReLU dead in that column for the batch would mask it.
        return torch.full_like(grad, ctx.value), None


class PoisonGrad(nn.Module):
    """Identity in forward; at chosen steps its backward writes NaN into the input gradient."""

    def __init__(self, steps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.steps = set(steps)
        self.step = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BadGrad.apply(x, float("nan")) if self.step in self.steps else x


class TinyNet(pl.LightningModule):
    """Linear -> Poison -> ReLU -> PoisonGrad -> Linear, with knobs to poison forward, backward, loss."""

    def __init__(self, forward_steps=(), backward_steps=(), loss_steps=(), param_grad_steps=(), lr=0.1,
                 scheduler: bool = False, optimizer: str = "sgd"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), Poison(forward_steps), nn.ReLU(), PoisonGrad(backward_steps))
        self.head = nn.Linear(16, 4)
        self.loss_steps = set(loss_steps)
        self.param_grad_steps = set(param_grad_steps)
        self.lr = lr
        self.use_scheduler = scheduler
        self.optimizer_name = optimizer

    def forward(self, x):
        for m in self.body:
            if isinstance(m, (Poison, PoisonGrad)):
                m.step = self.global_step
        h = self.body(x)
        if self.global_step in self.param_grad_steps:
            # The bias's gradient alone goes non-finite: the loss and every module's input-gradient stay finite.
            return F.linear(h, self.head.weight, _BadGrad.apply(self.head.bias, float("inf")))
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.global_step in self.loss_steps:
            loss = loss * torch.log(torch.zeros((), device=loss.device))  # -inf * positive
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(
        default_root_dir=str(tmp_path), max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, logger=pl.loggers.TensorBoardLogger(str(tmp_path)),
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


def read_events(log_dir: str):
    """All scalars and texts written under ``log_dir`` (any depth), read back with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    dirs = {os.path.dirname(p) for p in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)}
    for d in sorted(dirs):
        acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in tags.get("tensors", []):
            for e in acc.Tensors(tag):
                if e.tensor_proto.string_val:
                    texts.setdefault(tag.removesuffix("/text_summary"), []).append(
                        (e.step, e.tensor_proto.string_val[0].decode()))
    return scalars, texts


def snapshot(module: nn.Module) -> dict:
    """What must be identical before and after an opkit callback has been attached and removed."""
    hooks = {
        name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
               len(m._backward_pre_hooks), m._compiled_call_impl is None, sorted(k for k in vars(m) if callable(
                   vars(m)[k]) and not isinstance(vars(m)[k], nn.Module)))
        for name, m in module.named_modules()
    }
    params = {name: len(p._backward_hooks or {}) for name, p in module.named_parameters()}
    return {"hooks": hooks, "params": params, "keys": list(module.state_dict().keys()),
            "modes": torch.overrides._get_current_function_mode_stack() if hasattr(
                torch.overrides, "_get_current_function_mode_stack") else None}
