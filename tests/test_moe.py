"""Mixture-of-Experts: grouped expert GEMMs in the taxonomy and the roofline, dead experts named by index."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import SaveAt, TinyNet, make_loader, read_events, trainer
from zoo import MOE, ZooModule, _mixtral

from lightning_opkit import NaNDetector
from lightning_opkit.opclass import classify_function, classify_profiler_event
from lightning_opkit.profiler.roofline.work import class_rooflines


def _rows(experts: str):
    """The roofline's rows and the profiler's events of one forward and backward of the tiny Mixtral."""
    torch.manual_seed(0)
    model = _mixtral(experts)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        step()
    return class_rooflines(prof), [e.key for e in prof.key_averages()]


def test_grouped_expert_gemms_are_matmul_with_the_flops_of_the_same_gemms_run_one_by_one():
    grouped, keys = _rows("grouped_mm")
    eager, _ = _rows("eager")
    assert "aten::_grouped_mm" in keys  # forward and backward
    assert classify_function(torch._grouped_mm) == "matmul"
    assert {k: classify_profiler_event(k) for k in keys if "grouped" in k.lower()} == {
        k: "matmul" for k in keys if "grouped" in k.lower()}
    # the same tokens through the same experts: the loop of linears' GEMMs, FLOP for FLOP
    assert grouped["matmul"].flops == eager["matmul"].flops > 0
    # routing (which expert, tokens sorted and counted by expert) is layout: nothing of it left in "other"
    for op in ("aten::topk", "aten::sort", "aten::histc"):
        assert op in keys
        assert classify_profiler_event(op) == "layout"
    assert classify_profiler_event("aten::index_add_") == "reduction"  # the combine sums expert outputs


class NeverRouted(pl.Callback):
    """Routes every token away from one expert in every layer (a capacity mask or a router bug would)."""

    def __init__(self, expert: int):
        self.expert = expert
        self.handles = []

    def on_fit_start(self, trainer, pl_module):
        for name, module in pl_module.model.named_modules():
            if name.endswith("mlp.gate"):
                self.handles.append(module.register_forward_hook(self._away))

    def on_fit_end(self, trainer, pl_module):
        for handle in self.handles:
            handle.remove()

    def _away(self, module, args, output):
        logits, scores, index = output
        return logits, scores, torch.where(index == self.expert, (index + 1) % module.num_experts, index)


def test_an_expert_no_token_is_routed_to_is_named_by_its_index(tmp_path):
    torch.manual_seed(0)
    model = ZooModule(MOE)
    model.model.lm_head.weight.requires_grad_(False)  # frozen "by mistake", still handed to the optimizer
    detector = NaNDetector(dead_after=5)
    trainer = pl.Trainer(accelerator="cpu", max_steps=8, logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="",
                         version=""), callbacks=[detector, NeverRouted(3)], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, model.loader(n=32))
    found = {(d.parameter, d.expert, d.what, d.since, d.frozen) for d in detector._dead.found}
    experts = {(f"model.model.layers.{i}.mlp.experts.{w}", 3, "all-zero gradient", 0, False)
               for i in (0, 1) for w in ("gate_up_proj", "down_proj")}
    assert found == experts | {("model.lm_head.weight", None, "no gradient", 0, True)}
    named = [str(w.message) for w in caught if "no gradient over 5 checked steps" in str(w.message)]
    assert len(named) == 1  # once, for the live ones; the frozen head is in the table only
    assert "gate_up_proj[3]" in named[0]
    assert "lm_head" not in named[0]
    assert "no gradient over 5 checked steps: 5 parameter(s) or expert(s)" in "\n".join(detector.summary_lines())
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/nan/dead_parameters"][-1][1] == 5
    [(step, table)] = texts["opkit/nan/dead_parameters"]
    assert step == 4
    assert "| model.model.layers.0.mlp.experts.down_proj[3] | model.model.layers.0.mlp.experts |" in table


@pytest.mark.parametrize("value", [0, -3, 2.5, "10"])
def test_dead_after_must_be_a_positive_count(value):
    with pytest.raises(ValueError, match="dead_after"):
        NaNDetector(dead_after=value)


def test_the_grouped_gemm_transformers_runs_under_torch_compile_is_matmul_too():
    # Under dynamo, transformers swaps torch._grouped_mm for its own custom op when the weights are not bf16: a policy
    # that left it in `other` ran the experts in fp32 compiled and in bf16 eager (the zoo's compiled-policy test on
    # this model caught it: losses 5e-6 apart after one step)
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.*)

    assert classify_function(torch.ops.transformers.grouped_mm_fallback) == "matmul"
    assert classify_function(torch.ops.transformers.grouped_mm_fallback.default) == "matmul"
    assert classify_profiler_event("transformers::grouped_mm_fallback") == "matmul"
    assert classify_profiler_event("transformers::_grouped_mm_fallback_backward") == "matmul"


class WithUnusedLayer(TinyNet):
    """TinyNet with a layer the forward never calls: it never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)


def _dead_run(tmp_path, name, steps, save_at, ckpt=None):
    torch.manual_seed(0)
    detector, model = NaNDetector(dead_after=3), WithUnusedLayer()
    run = trainer(tmp_path / name, [detector, SaveAt(save_at, tmp_path / f"{name}.ckpt")], max_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, make_loader(), ckpt_path=ckpt)
    named = [str(w.message) for w in caught if "no gradient over 3 checked steps" in str(w.message)]
    return detector, named


def test_dead_parameter_counts_and_findings_resume_from_a_checkpoint(tmp_path):
    # two checked steps without a gradient, then a resume: the third (step 2) names it, counted from step 0
    _dead_run(tmp_path, "first", 6, save_at=2)
    detector, named = _dead_run(tmp_path, "resumed", 6, save_at=4, ckpt=tmp_path / "first.ckpt")
    assert [(d.parameter, d.since) for d in detector._dead.found] == [("unused.weight", 0), ("unused.bias", 0)]
    assert len(named) == 1
    # resumed again after it was named: kept, and not named a second time
    detector, named = _dead_run(tmp_path, "again", 6, save_at=-1, ckpt=tmp_path / "resumed.ckpt")
    assert [d.parameter for d in detector._dead.found] == ["unused.weight", "unused.bias"]
    assert named == []
    assert "2 parameter(s) or expert(s)" in "\n".join(detector.summary_lines())
