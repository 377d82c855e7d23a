import os
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_loader, read_events, snapshot, trainer
from torch import nn

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy
from lightning_opkit.compile.torch_compile import TorchCompile
from lightning_opkit.core.select import glob_match


@torch._dynamo.register_backend(name="opkit_test_failing")
def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend always fails")


class Block(nn.Module):
    def __init__(self, dim=16, graph_break=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.graph_break = graph_break

    def forward(self, x):
        h = self.fc(self.norm(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + F.gelu(h)


class Blocks(pl.LightningModule):
    def __init__(self, depth=4, graph_break=False):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(graph_break=graph_break) for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_state_dict_keys_and_checkpoints_are_those_of_the_plain_model(tmp_path):
    # a plain checkpoint resumes under compilation ...
    plain_run = trainer(tmp_path, [], max_epochs=1)
    plain_run.fit(Blocks(), make_loader(n=24))
    plain_ckpt = os.path.join(tmp_path, "plain.ckpt")
    plain_run.save_checkpoint(plain_ckpt)
    model = Blocks()
    plain_keys = list(model.state_dict())
    before = snapshot(model)
    t = trainer(tmp_path, [TorchCompile(backend="eager")], max_epochs=2)
    t.fit(model, make_loader(n=24), ckpt_path=plain_ckpt)
    assert model.global_step == 6
    # ... and a checkpoint saved while compiled loads strictly into a never-compiled model
    ckpt = os.path.join(tmp_path, "compiled.ckpt")
    t.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert list(state) == plain_keys
    assert not any("_orig_mod" in k for k in state)
    plain = Blocks.load_from_checkpoint(ckpt)
    x = torch.randn(5, 8)
    assert torch.equal(plain(x), model(x))
    assert snapshot(model) == before  # teardown undid the compilation


def test_regional_compiles_each_block_and_reports(tmp_path):
    cb = TorchCompile(modules=["blocks.*"], backend="eager")
    model = Blocks()
    trainer(tmp_path, [cb], max_steps=4).fit(model, make_loader())
    assert cb.compiled == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # not blocks.0.norm etc.
    assert cb.watch.frames >= 1
    assert cb.watch.compiles == 1
    idle = TorchCompile(modules=["blocks.*"], backend="eager")  # never set up, after a compile in this process
    assert (idle.watch.frames, idle.watch.frames_attempted, idle.watch.graph_breaks()) == (0, 0, {})
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/compile/compiles"][-1][1] == 1
    assert scalars["opkit/compile/compile_time_s"][-1][1] > 0
    assert scalars["opkit/compile/step_time_ms"][-1][1] > 0
    assert "blocks.0, blocks.1" in texts["opkit/compile/config"][0][1]
    assert "forward" not in vars(model.blocks[0])


def test_graph_breaks_are_reported_with_reasons(tmp_path):
    cb = TorchCompile(backend="eager")
    trainer(tmp_path, [cb], max_steps=2).fit(Blocks(graph_break=True), make_loader())
    breaks = cb.watch.graph_breaks()
    assert sum(breaks.values()) >= 1
    assert any("graph_break()" in r for r in breaks)
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/compile/graph_breaks"][-1][1] == sum(breaks.values())
    assert "| reason | count |" in texts["opkit/compile/graph_break_reasons"][-1][1]


def test_validation_shapes_recompile_a_bounded_number_of_times(tmp_path):
    cb = TorchCompile(backend="eager")
    # train batches of 8, validation batches of 5 and a last one of 3: sizes vary, recompiles stay bounded
    trainer(tmp_path, [cb], max_epochs=3, limit_val_batches=None, num_sanity_val_steps=0).fit(
        Blocks(), make_loader(n=32), make_loader(n=13, batch_size=5))
    assert 1 <= len(cb.watch.recompile_reasons) <= 4, cb.watch.recompile_reasons
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/compile/recompiles"][-1][1] == len(cb.watch.recompile_reasons)
    table = texts["opkit/compile/recompile_reasons"][-1][1]
    rows = [line for line in table.splitlines()[2:]]
    assert table.startswith("| function | guard that failed | count |")
    assert "| forward (" in table
    assert len(rows) == len(set(rows))
    assert sum(int(r.rsplit("|", 2)[1]) for r in rows) == len(
        cb.watch.recompile_reasons)


def test_fallback_warns_once_and_trains_eagerly(tmp_path):
    cb = TorchCompile(backend="opkit_test_failing")
    model = Blocks()
    before = snapshot(model)
    with pytest.warns(UserWarning, match="compilation failed.*always fails") as record:
        trainer(tmp_path, [cb], max_steps=3).fit(model, make_loader())
    assert sum("compilation failed" in str(w.message) for w in record) == 1
    assert model.global_step == 3
    assert "always fails" in cb.error
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/compile/eager_fallback"] == [(0, 1.0)]
    assert "always fails" in texts["opkit/compile/error"][0][1]
    assert snapshot(model) == before


def test_no_fallback_raises(tmp_path):
    model = Blocks()
    before = snapshot(model)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="always fails"):
        trainer(tmp_path, [TorchCompile(backend="opkit_test_failing", fallback=False)], max_steps=2).fit(
            model, make_loader())
    assert snapshot(model) == before


def test_warns_when_no_compiled_region_is_called(tmp_path):
    class Direct(Blocks):
        def training_step(self, batch, batch_idx):  # never calls self(...), which is what modules=None compiles
            x, y = batch
            return F.cross_entropy(self.head(self.blocks[0](self.inp(x))), y)

    with pytest.warns(UserWarning, match="nothing was compiled.*converted no frame"):
        trainer(tmp_path, [TorchCompile(backend="eager")], max_steps=1).fit(Direct(), make_loader())


def test_no_such_warning_when_compiled_code_is_reused(tmp_path):
    import warnings

    cb = TorchCompile(modules=["blocks.*"], backend="eager")
    trainer(tmp_path / "a", [cb], max_steps=2).fit(Blocks(), make_loader())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path / "b", [cb], max_steps=2).fit(Blocks(), make_loader())  # dynamo's cache is warm now
    assert not [w for w in record if "TorchCompile" in str(w.message)]


def test_inductor_compiles_for_real(tmp_path):
    cb = TorchCompile(modules=["blocks.*"])  # inductor, the default
    model = Blocks(depth=2)
    trainer(tmp_path, [cb], max_steps=3).fit(model, make_loader())
    assert cb.watch.compiles >= 1
    assert cb.error is None
    assert cb.watch.compile_time_s > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


class PoisonOnHuge(nn.Module):
    """Turns values above 1e3 into NaN: a data-dependent failure that compiles without a Python branch."""

    def forward(self, x):
        return torch.where(x.abs() > 1e3, torch.full_like(x, float("nan")), x)


class Guarded(Blocks):
    def __init__(self):
        super().__init__(depth=2)
        self.poison = PoisonOnHuge()

    def forward(self, x):
        return self.head(self.blocks[1](self.poison(self.blocks[0](self.inp(x)))))


def test_nan_detector_names_the_module_inside_a_compiled_model(tmp_path):
    x = torch.randn(64, 8)
    x[24:32] *= 1e6  # the fourth batch (global step 3) makes the poison fire
    y = torch.randint(0, 4, (64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = Guarded()
    before = snapshot(model)
    compile_cb = TorchCompile(backend="eager")
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [compile_cb, NaNDetector()], max_steps=6).fit(model, loader)
    assert (info.value.report["step"], info.value.report["module"]) == (3, "poison")
    assert compile_cb.watch.frames >= 1
    assert snapshot(model) == before


def test_precision_policy_mode_is_traced_into_the_compiled_graph(tmp_path):
    seen = {}

    class Probe(Blocks):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            seen["out"] = out.dtype
            return F.cross_entropy(out.float(), y)

    cb = TorchCompile(backend="eager")
    trainer(tmp_path, [PrecisionPolicy(census_every_n_steps=0), cb], max_steps=3).fit(Probe(), make_loader())
    assert seen["out"] == torch.bfloat16  # the head matmul ran in the policy's bf16, compiled
    assert cb.watch.frames >= 1
    assert cb.error is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="inductr"), r"`backend`.*'inductor'.*'inductr'"),
        (dict(mode="fast"), r"`mode`.*'max-autotune'.*'fast'"),
        (dict(options={"triton.cudagraph": True}), r"Unknown Inductor option.*triton.cudagraph.*triton.cudagraphs"),
        (dict(mode="default", options={"max_autotune": True}), "`mode` and `options`"),
        (dict(dynamic="yes"), "`dynamic`"),
        (dict(modules="blocks"), "`modules`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchCompile(**kwargs)


def test_inductor_options_reach_inductor_and_a_misspelt_one_is_refused_with_the_close_names():
    import inspect

    from lightning_opkit.compile.config import make_backend

    compiler = TorchCompile(options={"triton.cudagraphs": True})
    backend = make_backend(compiler.backend, compiler.mode, compiler.options, compiler.dynamic)
    assert inspect.getclosurevars(backend).nonlocals["backend"].config == {"triton.cudagraphs": True}
    with pytest.raises(ValueError, match=r"'triton.cudagraph'.*close valid names.*'triton.cudagraphs'"):
        TorchCompile(options={"triton.cudagraph": True})


def test_policy_module_override_hooks_apply_inside_compiled_regions(tmp_path):
    seen = {}

    class Probe(Blocks):
        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.blocks[0].fc(self.blocks[0].norm(self.inp(x)))
            seen["fc0"] = h.dtype
            return F.cross_entropy(self(x).float(), y)

    seen_in_graph = {}

    def record(module, args, output):
        seen_in_graph[module] = output.dtype

    model = Probe(depth=2)
    model.blocks[0].fc.register_forward_hook(record)
    model.blocks[1].fc.register_forward_hook(record)
    # hooks for the fp32 override are registered at setup, before the blocks' first (lazy) compilation
    policy = PrecisionPolicy(overrides={"blocks.0.fc": "fp32"}, census_every_n_steps=0)
    cb = TorchCompile(modules=["blocks.*"], backend="eager")
    trainer(tmp_path, [cb, policy], max_steps=2).fit(model, make_loader())
    assert seen_in_graph[model.blocks[0].fc] == torch.float32
    assert seen_in_graph[model.blocks[1].fc] == torch.bfloat16
    assert seen["fc0"] == torch.float32
    assert cb.watch.frames >= 1
    assert not cb.watch.graph_breaks()


def test_hooks_added_after_compilation_are_honoured(tmp_path):
    # Dynamo's default would keep running the graph compiled before the hook existed.
    calls = []
    model = Blocks(depth=2)
    cb = TorchCompile(modules=["blocks.*"], backend="eager")
    t = trainer(tmp_path, [cb], max_steps=4)

    class AddHookMidway(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                pl_module.blocks[1].fc.register_forward_hook(lambda m, a, o: calls.append(trainer.global_step))

    t.callbacks.append(AddHookMidway())
    t.fit(model, make_loader())
    assert calls == [2, 3]
    assert torch._dynamo.config.skip_nnmodule_hook_guards is True


def test_policy_census_counts_ops_inside_compiled_regions(tmp_path):
    policy = PrecisionPolicy(census_every_n_steps=2)
    cb = TorchCompile(modules=["blocks.*"], backend="eager")
    trainer(tmp_path, [policy, cb], max_steps=4).fit(Blocks(depth=4), make_loader())
    assert policy.census[("matmul", "bf16")]["calls"] == 6  # inp, four compiled blocks' fc, head
    assert policy.census[("norm", "fp32")]["calls"] == 4
    assert cb.error is None
    assert len(cb.watch.recompile_reasons) <= 1  # eager census steps do not churn the compiled code


# modules="auto", per-region figures, the recompile guard, old checkpoints (issue 12)


@pytest.mark.parametrize("name", ["torch_encoder", "torch_mha", "torch_lstm", "bn_cnn", "hf_gpt2", "hf_llama",
                                  "hf_bert"])
def test_auto_finds_and_compiles_the_blocks_of_every_zoo_model(tmp_path, name):
    from zoo import build

    model = build(name)
    expected = [n for n, _ in model.named_modules() if glob_match(n, "model." + model.case.blocks)]
    compiler = TorchCompile(modules="auto", backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [compiler], max_steps=2).fit(model, model.loader())
    nothing = [w for w in caught if re.search(r"nothing was compiled.*tried \d+ frame.*skipped them", str(w.message))]
    if name == "torch_lstm":
        # dynamo skips a block of nothing but an nn.LSTM and a norm up to torch 2.13 (said, not hidden); torch 2.15
        # converts a frame of it: the warning follows what dynamo did
        assert bool(nothing) == (compiler.watch.frames == 0), (compiler.watch.frames, nothing)
    else:
        assert compiler.watch.frames > 0
        assert not nothing
    assert compiler.compiled == expected
    assert len(expected) >= 2
    assert compiler.error is None
    _, texts = read_events(str(tmp_path))
    assert expected[0] in texts["opkit/compile/config"][0][1]


def test_auto_finds_the_example_vit_blocks(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from examples.vit import ViTClassifier, load_digits_tensors

    x, y = load_digits_tensors()
    model = ViTClassifier(depth=3)
    compiler = TorchCompile(modules="auto", backend="eager")
    trainer(tmp_path, [compiler], max_steps=2).fit(model, DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16))
    assert compiler.compiled == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert compiler.watch.frames > 0


def test_auto_without_repeated_blocks_fails_clearly(tmp_path):
    class Flat(Blocks):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), nn.Linear(16, 16)])

    with pytest.raises(ValueError, match="modules='auto'.*found no repeated blocks in Flat"):
        trainer(tmp_path, [TorchCompile(modules="auto", backend="eager")], max_steps=1).fit(Flat(), make_loader())


def test_per_region_figures_and_measured_speedup(tmp_path):
    # timed on its own calls (two warm-up, then three compiled and three eager, alternating): eight steps
    compiler = TorchCompile(modules=["blocks.*"], backend="eager", measure=True, eager_if_slower=False)
    trainer(tmp_path, [compiler], max_steps=8).fit(Blocks(depth=2), make_loader())
    first, second = compiler.regions["blocks.0"], compiler.regions["blocks.1"]
    assert first.calls == second.calls == 8
    assert first.compiles >= 1
    assert first.compile_time_s > 0
    assert first.graphs >= 1
    assert second.compiles <= 1  # the same code object: compiled once for the first block (+1 for requires_grad)
    assert first.speedup is not None
    assert first.speedup > 0
    assert second.speedup is not None
    _, texts = read_events(str(tmp_path))
    table = texts["opkit/compile/regions"][-1][1]
    assert "| blocks.0 | 8 |" in table
    assert "speedup (eager/compiled)" in table


class Scaled(nn.Module):
    """A block whose Python int attribute differs per instance: dynamo specializes on it, one version per block."""

    def __init__(self, scale):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = scale

    def forward(self, x):
        return x + self.fc(x) * self.scale


class ScaledBlocks(Blocks):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(i + 1) for i in range(7))


@pytest.mark.parametrize("action", ["warn", "eager", "raise"])
def test_recompile_guard_fires_at_half_the_limit(tmp_path, action):
    compiler = TorchCompile(modules=["blocks.*"], backend="eager", on_recompile_limit=action)
    model = ScaledBlocks()
    run = trainer(tmp_path, [compiler], max_steps=3)
    if action == "raise":
        with pytest.raises(RuntimeError, match=r"half of torch._dynamo.config.recompile_limit=8.*scale"):
            run.fit(model, make_loader())
        return
    with pytest.warns(UserWarning, match=r"4 compiled versions of its code \(shared by 7 region\(s\)\).*scale"):
        run.fit(model, make_loader())
    versions = len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(compiler.regions["blocks.0"].code))
    if action == "eager":
        assert versions == 4
        assert all(r.eager for r in compiler.regions.values())
        scalars, _ = read_events(str(tmp_path))
        assert scalars["opkit/compile/eager_regions"][-1][1] == 7
    else:
        assert versions == 7
        assert not any(r.eager for r in compiler.regions.values())


def test_checkpoints_with_orig_mod_keys_load(tmp_path):
    from lightning_opkit import strip_compile_prefix

    class Wrapped(Blocks):  # the usual way: torch.compile's wrapper assigned in the LightningModule
        def __init__(self):
            super().__init__()
            self.inp = torch.compile(self.inp, backend="eager")

    old = trainer(tmp_path / "old", [], max_steps=2)
    old.fit(Wrapped(), make_loader())
    ckpt = os.path.join(tmp_path, "old.ckpt")
    old.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert "inp._orig_mod.weight" in state
    # into the plain model, with TorchCompile attached: resumes
    model = Blocks()
    trainer(tmp_path / "new", [TorchCompile(modules=["blocks.*"], backend="eager")], max_steps=12,
            max_epochs=2).fit(model, make_loader(), ckpt_path=ckpt)
    assert model.global_step > 2
    # and with the helper, without TorchCompile
    plain = Blocks()
    plain.load_state_dict(strip_compile_prefix(state))  # strict
    assert torch.equal(plain.inp.weight, state["inp._orig_mod.weight"])


# ---- compile where it pays: a region measured slower compiled runs eagerly


SLOW_CALLS = []


def _slow_backend(gm, example_inputs):
    """The eager backend, 20 ms slower per call: a region slower compiled than eager by construction."""
    import time

    def run(*args):
        SLOW_CALLS.append(1)
        time.sleep(0.02)
        return gm.forward(*args)

    return run


torch._dynamo.register_backend(_slow_backend, name="opkit_test_slow")


def test_a_region_slower_compiled_runs_eagerly_after_its_measurement(tmp_path):
    from lightning_opkit.core.facts import facts_of

    compiler = TorchCompile(modules=["blocks.*"], backend="opkit_test_slow")
    model = Blocks(depth=2)
    SLOW_CALLS.clear()
    run = trainer(tmp_path, [compiler], max_steps=11)
    run.fit(model, make_loader(n=96))
    for name in ("blocks.0", "blocks.1"):
        region = compiler.regions[name]
        assert region.speedup is not None
        assert region.speedup < 1 / 1.1  # measured: eager time / compiled time
        assert region.slower
        assert region.runs == "eager (compiled measured slower)"
        assert facts_of(run).eager_regions[name] == region.speedup  # the kit knows: the roofline reads it
    # two warm-up calls and six timed ones, then eager: its compiled code kept, unused
    assert compiler.regions["blocks.0"].calls == 11
    assert len(SLOW_CALLS) == 2 * (2 + 3)  # per region: the warm-up and the three compiled trial calls, no more
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/compile/eager_regions"][-1][1] == 2
    assert "eager (compiled measured slower)" in texts["opkit/compile/regions"][-1][1]


def test_eager_if_slower_off_keeps_every_region_compiled_and_still_reports_its_speedup(tmp_path):
    compiler = TorchCompile(modules=["blocks.*"], backend="opkit_test_slow", eager_if_slower=False)
    trainer(tmp_path, [compiler], max_steps=11).fit(Blocks(depth=2), make_loader(n=96))
    assert not any(r.slower for r in compiler.regions.values())
    assert all(r.speedup is not None and r.speedup < 1 for r in compiler.regions.values())  # measured slower


def test_measure_off_times_nothing_and_keeps_every_region_compiled(tmp_path):
    compiler = TorchCompile(modules=["blocks.*"], backend="opkit_test_slow", measure=False)
    trainer(tmp_path, [compiler], max_steps=11).fit(Blocks(depth=2), make_loader(n=96))
    assert not any(r.slower for r in compiler.regions.values())
    assert all(r.speedup is None for r in compiler.regions.values())


def test_recompiles_every_run_has_are_counted_not_warned(tmp_path, recwarn):
    # training and validation flip grad mode; the policy's table changes after it measured: bounded recompiles
    compiler = TorchCompile(modules=["blocks.*"], backend="eager", eager_if_slower=False)
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    run = trainer(tmp_path, [policy, compiler], max_steps=12, limit_val_batches=2, val_check_interval=3)
    run.fit(Blocks(depth=2), make_loader(n=192), make_loader(n=32))
    region = compiler.regions["blocks.0"]
    assert region.recompiles >= 1
    assert region.expected_recompiles == region.recompiles
    assert not region.unexpected
    assert not [w for w in recwarn if "compiled versions of its code" in str(w.message)]
    _, texts = read_events(str(tmp_path))
    assert f"| {region.recompiles} | {region.expected_recompiles} |" in texts["opkit/compile/regions"][-1][1]


def test_dynamos_wrapper_frame_gaining_a_callable_is_no_recompile_of_the_region():
    # torch 2.9 compiles a torch.nn forward through dynamo's one wrapper frame; each wrapped bound method (another
    # region, another fit) adds an entry guarded on its identity: a recompile-limit warning there was a false alarm
    from collections import Counter

    from lightning_opkit.compile.watch import expected_recompile

    reason = ("Recompiling function inner in /venv/torch/_dynamo/external_utils.py:66\n triggered by the following"
              " guard failure(s):\n - 0/2: ___check_obj_id(fn, 140205556341568)\n - 0/1: Cache line invalidated"
              " because L['fn'] got deallocated")
    assert all(expected_recompile(reason, Counter()) for _ in range(20))
    # the same guard in a region's own code is a real recompile
    assert not expected_recompile(reason.replace("inner in /venv/torch/_dynamo/external_utils.py", "forward in m.py"),
                                  Counter())


class _Fp32Block(nn.Module):
    """Computes in fp32 under bf16-mixed (``autocast(enabled=False)`` inside, as a numerics-minded user writes it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 64)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return F.gelu(self.fc(x.float()))


class _Fp32Inside(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = _Fp32Block()
        self.head = nn.Linear(64, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.block(x)).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_compiled_region_s_backward_runs_outside_autocast_as_eager_s_does(tmp_path):
    """Under bf16-mixed, AOTAutograd traced a compiled region's backward under the forward's autocast: the block's
    fp32 forward got bf16 GEMMs in backward, and different weights than eager. The observer is the eager run."""
    weights = {}
    for compiled in (False, True):
        model = _Fp32Inside()
        callbacks = [TorchCompile(backend="aot_eager", modules=["block"], measure=False)] if compiled else []
        trainer(tmp_path / str(compiled), callbacks, max_steps=3, precision="bf16-mixed").fit(model, make_loader())
        weights[compiled] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[False])
    import torch._functorch.config as functorch_config

    assert functorch_config.backward_pass_autocast == "same_as_forward"  # the user's setting is back after the fit


def test_identical_blocks_share_one_trial_and_one_verdict(tmp_path):
    """Three calls of each, judged apart, gave the example's four identical blocks 1.47x, 1.03x, 0.86x and 1.11x in
    one run, and ran one of them eagerly. Blocks sharing their compiled code and parameter shapes now pool their calls
    (as many in all) into one trial and take one verdict."""
    compiler = TorchCompile(modules=["blocks.*"], backend="eager", measure=True, eager_if_slower=False)
    trainer(tmp_path, [compiler], max_steps=8).fit(Blocks(depth=3), make_loader())
    speedups = [r.speedup for r in compiler.regions.values()]
    assert len(speedups) == 3
    assert None not in speedups
    assert len(set(speedups)) == 1
