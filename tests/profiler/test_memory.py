"""ProfilerWindows(memory_breakdown=True): bytes by kind exact, activations per block counted apart, read back."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import read_events, read_images
from torch import nn
from zoo import ZooModule, build

from lightning_opkit import NaNDetector, ProfilerWindows
from lightning_opkit.profiler.memory import MemoryProbe, tensor_bytes


def _independent(model, batch, blocks):
    """Bytes autograd saves in one forward, each storage once, parameters apart: in all, and while each block runs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside: list[str] = []
    total: set = set()
    per_block: dict[str, set] = {b: set() for b in blocks}
    handles = []
    for name in blocks:
        block = model.get_submodule(name)
        handles.append(block.register_forward_pre_hook(lambda m, a, name=name: inside.append(name)))
        handles.append(block.register_forward_hook(lambda m, a, o: inside.pop() and None))

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[0] not in params:
            total.add(key)
            if inside:
                per_block[inside[-1]].add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch)
    del loss
    for handle in handles:
        handle.remove()
    return sum(n for _, n in total), {b: sum(n for _, n in keys) for b, keys in per_block.items()}


@pytest.mark.parametrize("name", ["hf_gpt2", "torch_encoder", "bn_cnn"])
def test_memory_view_matches_independent_counts_and_is_read_back(tmp_path, name):
    model = build(name)
    windows = ProfilerWindows(every_n_steps=3, warmup=1, active=1, memory_breakdown=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=5, logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="",
                         version=""), callbacks=[windows], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, model.loader(n=48))
    report = windows.memory_report
    assert report is not None
    blocks = list(report.by_block_class)
    assert len(blocks) == 2

    # parameters, gradients and optimizer state: exact
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert report.parameters == sum(params.values())
    assert report.gradients == sum(params.values())  # every parameter trains, in its own dtype
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert report.optimizer == sum(v.untyped_storage().nbytes() for v in state) > 0

    # activations: within 15% of an independent count, in all and per block
    batch = next(iter(model.loader(n=48)))
    total, per_block = _independent(model, batch, blocks)
    assert report.activations == pytest.approx(total, rel=0.15)
    for block in blocks:
        assert per_block[block] > 0
        assert report.activations_by_module[block] == pytest.approx(per_block[block], rel=0.15), block
    assert sum(report.activations_by_class.values()) == report.activations
    assert report.peak is not None
    assert report.peak > 0  # CPU: the profiler's peak of allocations over the recorded steps
    assert set(report.block_forward_s) == set(blocks)

    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/memory/activations_mb"][-1][1] == pytest.approx(report.activations / 2**20)
    assert scalars["opkit/memory/parameters_mb"][-1][1] == pytest.approx(report.parameters / 2**20)
    modules = texts["opkit/memory/modules"][-1][1]
    assert f"| {blocks[0]} |" in modules
    assert "**lever**" in modules
    top = max(report.activations_by_class, key=report.activations_by_class.get)
    assert f"| {top} | {report.activations_by_class[top] / 2**20:.2f} |" in texts["opkit/memory/op_classes"][-1][1]
    assert "input" in report.activations_by_class  # the batch (or the embedding's ids) that no op produced
    [(step, width, height, png)] = read_images(str(tmp_path))["opkit/memory/blocks"]
    assert (width, height) == (900, 480)
    assert png[:4] == b"\x89PNG"
    assert any("memory (step" in line for line in windows.summary_lines())
    # nothing stays registered between windows: no global module hooks, no saved-tensor hooks
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


class RunsOutOfMemory(ZooModule):
    """A zoo model whose training step, at ``at``, asks the CPU allocator for more than any machine has."""

    def __init__(self, name: str, at: int) -> None:
        super().__init__(name)
        self.at = at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            torch.empty(2**50, dtype=torch.uint8)  # a real allocation failure, not a raised stand-in
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("memory", [True, False])
def test_out_of_memory_prints_the_last_windows_memory_and_the_lever(tmp_path, capsys, memory):
    model = RunsOutOfMemory("hf_gpt2", at=4)
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, memory_breakdown=memory, memory_snapshot=True,
                              export_trace=False)
    # NaNDetector first: the summary is written by the first opkit callback, before ProfilerWindows' own on_exception
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, callbacks=[NaNDetector(), windows], enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         logger=pl.loggers.TensorBoardLogger(str(tmp_path)))
    with pytest.warns(UserWarning, match="memory_snapshot=True.* records CUDA allocations; this run is on cpu"), \
            pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer.fit(model, model.loader())
    out = capsys.readouterr().out
    assert "opkit run summary (ended by RuntimeError" in out
    if memory:
        report = windows.memory_report
        assert report is not None
        assert report.step <= model.at  # a window before the failure; the one open when it failed recorded nothing
        assert f"memory (step {report.step}): parameters {report.parameters / 2**20:.1f} MB" in out
        assert f"lever: {report.lever()}" in out
        assert "ActivationCheckpointing(modules=" in report.lever()  # GPT-2's blocks hold most of the activations
        assert f"out of memory: the memory lines above are the last window's (step {report.step})" in out
    else:
        assert "out of memory: ProfilerWindows(memory_breakdown=True) shows which blocks hold the activations" in out
    assert windows.snapshot_file is None  # CUDA's history only: on a CPU, warned at setup and nothing written
    assert "memory snapshot:" not in out


class _MLP(pl.LightningModule):
    """The MLP of issue 36's report: 64-512-256-4 on batches of 512."""

    def __init__(self, optimizer: str):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 4))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_cpu_peak_counts_the_step_under_any_optimizer_and_names_the_step_probed(tmp_path):
    # Lightning runs forward and backward inside optimizer.step: summed per op, Adam's step was charged the frees of
    # the whole forward and backward at its start, and the peak came out below the activations the step held.
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(512 * 6, 64, generator=g), torch.randint(0, 4, (512 * 6,), generator=g)), batch_size=512)
    reports = {}
    for optimizer in ("sgd", "adam"):
        windows = ProfilerWindows(every_n_steps=4, warmup=1, active=2, memory_breakdown=True)
        trainer = pl.Trainer(accelerator="cpu", max_steps=6, logger=False, callbacks=[windows],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path))
        trainer.fit(_MLP(optimizer), data)
        reports[optimizer] = windows.memory_report
        assert windows.memory_report.step == 4  # the window's first step, probed; it ended at step 6
        assert "memory (step 4)" in "\n".join(windows.summary_lines())
    for report in reports.values():
        assert report.peak >= report.activations > 0
    assert reports["adam"].optimizer > 0 == reports["sgd"].optimizer
    # the same forward and backward, the same allocations above what the window began with (the optimizer's state
    # is older than the window)
    assert reports["adam"].peak >= 0.9 * reports["sgd"].peak


def test_tensor_bytes_count_each_storage_once_views_and_shared_weights_included():
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied weights: one storage
    params = [*embedding.parameters(), *head.parameters()]
    assert tensor_bytes(params) == 10 * 4 * 4
    x = torch.zeros(8, 8)
    assert tensor_bytes([x, x[:2], x.t(), "not a tensor"]) == 8 * 8 * 4
    assert tensor_bytes([torch.zeros(3, dtype=torch.bfloat16)]) == 6


@pytest.mark.parametrize("region", ["model", None])
def test_blocks_inside_a_compiled_region_are_probed_eagerly_and_nothing_recompiles(tmp_path, region):
    """A region holding the blocks (the whole model compiled, or the LightningModule's forward) traced the probe's hooks
    and recompiled each window (21 recompiles, 27 graph breaks on the zoo GPT-2). The probed step now runs eagerly:
    nothing recompiles (dynamo's own log), and its figures are those of the same step in a run that compiles
    nothing."""
    from helpers import trainer
    from observer import DynamoRecompiles

    from lightning_opkit import TorchCompile

    reports = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build("hf_gpt2")
        windows = ProfilerWindows(every_n_steps=3, warmup=1, active=1, memory_breakdown=True, export_trace=False)
        modules = [region] if region is not None else None
        callbacks = [windows] + ([TorchCompile(modules=modules, backend="eager", measure=False)] if compiled else [])
        with DynamoRecompiles() as recompiles:
            trainer(tmp_path / str(compiled), callbacks, max_steps=8).fit(model, model.loader(n=32))
        assert not recompiles.on_hooks(), recompiles.messages
        reports[compiled] = windows.memory_report
        assert reports[compiled].eager == compiled
        assert ("probed eagerly" in "\n".join(windows.summary_lines())) == compiled
    eager, compiled = reports[False], reports[True]
    assert compiled.activations == eager.activations > 0
    assert compiled.activations_by_module == eager.activations_by_module


def test_the_eager_probe_leaves_no_forced_stance_behind_what_the_step_enters():
    """The policy's census forces eager around the whole training step, inside the probe's batch. The probe left its
    stance before backward, inside the census's: the census then put back the forced stance it had found, and the rest
    of the fit (43 later tests in one process) compiled nothing."""
    import torch._dynamo.eval_frame as eval_frame  # the stance object is replaced, not changed: read it each time

    net = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    probe = MemoryProbe(net, blocks=["1"], compiled=[""])
    assert probe.eager
    probe.begin(step=0)
    with torch.compiler.set_stance("force_eager"):  # what a census step (or a replay) enters inside the step
        loss = net(torch.ones(4, 8)).sum()
        probe.forward_done()
        loss.backward()
    assert eval_frame._stance.stance == "force_eager"  # the probed step is still eager until its batch ends
    probe.step_done()
    assert eval_frame._stance.stance == "default"
    assert probe.report([]).activations_by_module["1"] > 0
