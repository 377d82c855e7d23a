"""The model's graph in TensorBoard's Graphs tab: read back from the event file, the model and the run unchanged."""

import lightning.pytorch as pl
import torch
from helpers import make_loader, snapshot, trainer
from observer import event_dirs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from examples.vit import ViTClassifier, load_digits_tensors
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.profiler.graph import draw_graph, example_inputs, export_graph
from lightning_opkit.profiler.windows import ProfilerWindows


def _vit_loader():
    images, labels = load_digits_tensors()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images[:64], labels[:64]), batch_size=16)


class Losses(pl.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the loss, and the next number of the RNG stream: a graph drawn with the run's random numbers would show
        self.values.append((outputs["loss"].item(), torch.rand(1).item()))


def _fit(tmp_path, graph):
    torch.manual_seed(0)
    model, losses = ViTClassifier(), Losses()
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, graph=graph)
    trainer(tmp_path, [windows, losses], max_steps=4).fit(model, _vit_loader())
    return model, windows, losses.values


def test_the_vit_graph_is_in_the_event_file_by_module_and_the_run_is_as_without_it(tmp_path):
    model, windows, losses = _fit(tmp_path / "graph", graph=True)
    (logs,) = event_dirs(tmp_path / "graph")
    accumulator = EventAccumulator(logs)
    accumulator.Reload()
    graph = accumulator.Graph()  # TensorBoard's own reader: what the Graphs tab shows
    names = {node.name: node for node in graph.node}
    qkv = names["model/blocks/0/attn/qkv/linear"]
    assert qkv.op == "aten.linear.default"
    assert list(qkv.input) == ["model/blocks/0/norm1/layer_norm", "model/blocks/0/attn/qkv/weight",
                               "model/blocks/0/attn/qkv/bias"]
    assert qkv.attr["op_class"].s == b"matmul"
    assert [d.size for d in qkv.attr["_output_shapes"].list.shape[0].dim] == [16, 16, 192]
    assert sum(1 for n in names if n.endswith("/weight")) == sum(1 for n, _ in model.named_parameters()
                                                                   if n.endswith("weight"))
    assert any(line.startswith("profiler:") and "graph: drawn from the batch's first element" in line
               for line in windows.summary_lines())
    # drawn on fake tensors: the same weights, the same random numbers, the same losses as a run without it
    other, _, plain = _fit(tmp_path / "plain", graph=False)
    assert losses == plain
    assert snapshot(model) == snapshot(other)


def test_a_model_export_cannot_draw_is_named_in_the_summary_and_the_fit_goes_on(tmp_path):
    class DataDependent(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            if x.sum() > 0:  # control flow on a value: export cannot trace it
                return self.fc(x)
            return -self.fc(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, graph=True)
    trainer(tmp_path, [windows], max_steps=3).fit(DataDependent(), make_loader())
    assert windows.graph_note.startswith("not drawn (the batch: ")
    assert "the batch's first element: " in windows.graph_note
    (logs,) = event_dirs(tmp_path)
    accumulator = EventAccumulator(logs)
    accumulator.Reload()
    assert not accumulator.Tags()["graph"]


def test_example_input_array_is_tried_first():
    model = nn.Linear(2, 2)
    model.example_input_array = torch.ones(3, 2)
    assert [what for what, _, _ in example_inputs(model, None)] == ["example_input_array"]
    graph, what = export_graph(model, None)
    assert what == "example_input_array"
    assert {n.op for n in graph.node} == {"Input", "Parameter", "aten.linear.default", "Output"}


def test_a_sharded_model_is_not_exported_on_one_rank(tmp_path):
    """FSDP2's hooks all-gather in the forward: an export on rank zero alone would hang the others."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    writer = LogWriter(pl.Trainer(logger=False), log_dir=str(tmp_path))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert draw_graph(writer, model, torch.ones(2, 8)).startswith("not drawn (sharded parameters")
    finally:
        dist.destroy_process_group()
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert draw_graph(writer, plain, torch.ones(2, 8)) == "drawn from the batch (Graphs tab)"
    writer.close()
    (logs,) = event_dirs(tmp_path)
    accumulator = EventAccumulator(logs)
    accumulator.Reload()
    assert {n.name for n in accumulator.Graph().node} >= {"0/linear", "0/weight", "2/weight", "output"}
