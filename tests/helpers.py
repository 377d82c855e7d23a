"""Tiny real models for the tests, and a reader for TensorBoard event files."""

from __future__ import annotations

import glob
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_opkit import PrecisionPolicy
from lightning_opkit.core.torch_compat import FUNCTION_MODES_UNDER_AOT

#: this folder, where the 2-process scripts are, and the repository's root (docs, examples, benchmarks)
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


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
        elif self.optimizer_name == "fused_adamw":  # takes found_inf: NaNDetector(decide="device")
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=True)
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
            if tag == "custom_scalars__config__":
                continue  # a serialized layout, read by read_layout
            for e in acc.Tensors(tag):
                if e.tensor_proto.string_val:
                    texts.setdefault(tag.removesuffix("/text_summary"), []).append(
                        (e.step, e.tensor_proto.string_val[0].decode()))
    return scalars, texts


def read_images(log_dir: str) -> dict[str, list[tuple[int, int, int, bytes]]]:
    """All images written under ``log_dir``: tag -> ``(step, width, height, encoded PNG)``, via EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images: dict[str, list[tuple[int, int, int, bytes]]] = {}
    dirs = {os.path.dirname(p) for p in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)}
    for d in sorted(dirs):
        acc = EventAccumulator(d, size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags().get("images", []):
            images.setdefault(tag, []).extend((e.step, e.width, e.height, e.encoded_image_string)
                                              for e in acc.Images(tag))
    return images


def read_layout(log_dir: str) -> dict[str, dict[str, list[str]]]:
    """The custom-scalars layouts written under ``log_dir``: category -> chart title -> tag regexes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    found: dict[str, dict[str, list[str]]] = {}
    for path in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(os.path.dirname(path), size_guidance={"tensors": 0})
        acc.Reload()
        if "custom_scalars__config__" not in acc.Tags().get("tensors", []):
            continue
        for event in acc.Tensors("custom_scalars__config__"):
            layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
            for category in layout.category:
                charts = found.setdefault(category.title, {})
                for chart in category.chart:
                    charts[chart.title] = list(chart.multiline.tag)
    return found


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


def full_state(trainer, pl_module) -> dict:
    """Everything a training step may change: parameters, buffers, optimizer state, learning rates."""

    def clone(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(clone(v) for v in value)
        return value

    return {
        "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in pl_module.named_buffers()},
        "optim": [clone(opt.state_dict()) for opt in trainer.optimizers],
        "lr": [g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
    }


def state_differences(a, b) -> list[str]:
    """Names of what differs (bit for bit) between two :func:`full_state` results."""

    def walk(x, y, path):
        if isinstance(x, torch.Tensor):
            return [] if isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(
                x.nan_to_num(1234.5), y.nan_to_num(1234.5)) else [path]
        if isinstance(x, dict):
            if set(x) != set(y):
                return [path]
            return [d for k in x for d in walk(x[k], y[k], f"{path}.{k}")]
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                return [path]
            return [d for i, (u, v) in enumerate(zip(x, y)) for d in walk(u, v, f"{path}[{i}]")]
        return [] if x == y else [path]

    return walk(a, b, "state")


class StepProbe(pl.Callback):
    """Records the full state before and after the chosen global steps, and the loss of every step."""

    def __init__(self, steps=()):
        self.steps = set(steps)
        self.before: dict[int, dict] = {}
        self.after: dict[int, dict] = {}
        self.losses: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps:
            self.before[trainer.global_step] = full_state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the step that just ran
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses[step] = float(loss)
        if step in self.steps:
            self.after[step] = full_state(trainer, pl_module)


class SkewedAuto(PrecisionPolicy):
    """rules="auto" where rank 1 measures every 16-bit dtype 10x faster than fp32: only a broadcast of rank zero's
    decisions keeps the ranks on one table."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        measure = self._auto._measure  # rules="auto"'s Trainer-free part measures through this

        def skewed(model, batch, loss_fn, **kwargs):
            measurements = measure(model, batch, loss_fn, **kwargs)
            if model.global_rank == 1:
                for row in measurements:
                    row.time_ratio, row.loss_change, row.grad_cosine, row.failed = 0.1, 0.0, 1.0, None
            return measurements

        self._auto._measure = skewed


class SaveAt(pl.Callback):
    """Saves a checkpoint mid-run, at the end of the batch that brings ``global_step`` to ``step``."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, str(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def policy_refused_under(backend) -> bool:
    """Whether TorchCompile refuses ``backend`` beside a PrecisionPolicy on this torch (before 2.11: AOT autograd
    traced the policy's casts into a wrong backward there); a test then checks the refusal instead of the run."""
    return backend not in (None, "eager") and not FUNCTION_MODES_UNDER_AOT


REFUSED = "with a PrecisionPolicy needs torch 2.11 or newer"


def profiled(step):
    """A torch.profiler run (shapes and FLOPs recorded) of ``step``, after one warm-up call."""
    step()
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        step()
    return prof


def _raw(formula):
    def counted(*args, **kwargs):
        return formula(*args, **kwargs)

    counted._get_raw = True  # already shape-wrapped by torch's registration
    return counted


def flop_counter():
    """FlopCounterMode, with its own SDPA formulas applied to CPU's flash attention too (it leaves that op at 0)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _raw(sdpa_flop),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _raw(sdpa_backward_flop)})
