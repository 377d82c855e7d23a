"""Lightning's and torchmetrics' private names behind core/lightning_compat.py, each used for real on the running
release: one that moves fails here first."""

import lightning.pytorch as pl
import torch
from helpers import make_loader
from torchmetrics import MeanMetric, Metric

from lightning_opkit.core.lightning_compat import attached_trainer, metric_state_names, wrapped_optimizers


class _Manual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Linear(8, 2)
        self.seen = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.seen.append((opt, wrapped_optimizers(self.trainer), attached_trainer(self)))
        loss = self.net(batch[0]).float().pow(2).mean()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_wrappers_a_manual_step_gets_are_the_ones_found_and_the_trainer_is_attached(tmp_path):
    module = _Manual()
    assert attached_trainer(module) is None
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, make_loader())
    opt, found, attached = module.seen[0]
    assert found == [opt]  # the very object self.optimizers() returned
    assert attached is trainer


class _Count(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", default=torch.zeros(()), dist_reduce_fx="sum")
        self.add_state("items", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.total += x.sum()
        self.items.append(x)

    def compute(self):
        return self.total


def test_a_metric_s_states_are_the_ones_it_added():
    assert metric_state_names(_Count()) == ["total", "items"]
    assert set(metric_state_names(MeanMetric())) == {"mean_value", "weight"}
