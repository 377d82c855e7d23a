"""ActivationCheckpointing on zoo models: bytes cut, numerics kept, selective keeps more, composes, undone."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import REFUSED, policy_refused_under, read_events, snapshot
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import CASES, build

from lightning_opkit import PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.checkpointing.activation_checkpointing import ActivationCheckpointing
from lightning_opkit.core.saved import SavedBytes


class Losses(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(tmp_path, name, callbacks, steps=10, **trainer_kwargs):
    model = build(name)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=pl.loggers.TensorBoardLogger(
        str(tmp_path), name="", version=""), callbacks=[*callbacks, losses], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **trainer_kwargs)
    trainer.fit(model, model.loader(n=48))
    return model, losses.losses


@pytest.mark.parametrize("name", ["torch_encoder", "hf_gpt2", "hf_llama"])
def test_full_checkpointing_cuts_saved_bytes_and_keeps_losses_and_weights(tmp_path, name):
    plain, plain_losses = _fit(tmp_path / "plain", name, [])
    checkpointing = ActivationCheckpointing(measure=True, trial_steps=2)
    model, losses = _fit(tmp_path / "ac", name, [checkpointing])
    assert checkpointing.checkpointed == [p for p in checkpointing.checkpointed if ".layers." in p or ".h." in p]
    assert len(checkpointing.checkpointed) == 2
    assert losses == plain_losses  # recomputed in backward, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values(),
                                                  strict=True))
    price = checkpointing.price
    assert price is not None
    assert price.cut >= 0.4
    assert price.saved_with < price.saved_without
    assert price.step_s_with > 0
    scalars, texts = read_events(str(tmp_path / "ac"))
    assert scalars["opkit/checkpointing/saved_mb_without"][-1][1] == pytest.approx(price.saved_without / 2**20)
    assert scalars["opkit/checkpointing/saved_cut"][-1][1] == pytest.approx(price.cut)
    assert "less), step time x" in texts["opkit/checkpointing/report"][-1][1]
    assert "forward" not in vars(model.get_submodule(checkpointing.checkpointed[0]))  # undone at teardown


def test_batchnorm_statistics_are_updated_once_per_step_not_again_by_the_recompute(tmp_path):
    plain, plain_losses = _fit(tmp_path / "plain", "bn_cnn", [])
    checkpointing = ActivationCheckpointing(measure=False)
    model, losses = _fit(tmp_path / "ac", "bn_cnn", [checkpointing])
    assert checkpointing.checkpointed == ["model.layers.0", "model.layers.1"]
    assert losses == plain_losses
    state, plain_state = model.state_dict(), plain.state_dict()
    assert [k for k in state if "running_mean" in k]
    assert all(torch.equal(state[k], plain_state[k]) for k in state)  # running statistics and counts included


def test_the_measured_bytes_agree_with_an_independent_count_of_what_autograd_saves():
    model = build("torch_encoder")
    batch = next(iter(model.loader()))
    counts = {}
    for label, wrap in (("without", False), ("with", True)):
        if wrap:
            for name in ("model.encoder.layers.0", "model.encoder.layers.1"):
                module = model.get_submodule(name)
                from lightning_opkit.checkpointing.region import CheckpointedForward

                module.forward = CheckpointedForward(module, module.forward, ())
        saved = set()

        def pack(t, saved=saved):
            saved.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch).backward()
        counts[label] = sum(n for ptr, n in saved if ptr not in params)
        counter = SavedBytes(model)
        with counter.counting():
            model(batch).backward()
        assert counter.activations == counts[label]
    assert counts["with"] < 0.6 * counts["without"]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ("aten::mm", "aten::addmm", "aten::bmm"):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_keeps_the_gemms_and_recomputes_less(tmp_path):
    full, selective = ActivationCheckpointing(measure=True, trial_steps=2), ActivationCheckpointing(
        save=["matmul", "attention"], measure=True, trial_steps=2)
    _, full_losses = _fit(tmp_path / "full", "hf_gpt2", [full])
    _, selective_losses = _fit(tmp_path / "sel", "hf_gpt2", [selective])
    assert full_losses == selective_losses
    assert full.price.saved_with < selective.price.saved_with < selective.price.saved_without  # keeps more

    # recomputes less: GEMMs run in backward, counted by torch's dispatcher
    def gemms_in_backward(save):
        model = build("hf_gpt2")
        batch = next(iter(model.loader()))
        from lightning_opkit.checkpointing.region import CheckpointedForward

        for i in (0, 1):
            block = model.model.transformer.h[i]
            block.forward = CheckpointedForward(block, block.forward, save)
        loss = model(batch)
        with CountOps() as ops:
            loss.backward()
        return ops.mm

    assert gemms_in_backward(("matmul", "attention")) < gemms_in_backward(())


def test_recompute_runs_in_the_policys_dtypes_and_the_census_counts_once(tmp_path):
    def run(callbacks):
        policy = PrecisionPolicy(rules={"matmul": "bf16", "norm": "fp32"}, census_every_n_steps=1)
        model, losses = _fit(tmp_path / str(len(callbacks)), "hf_gpt2", [policy, *callbacks], steps=3)
        return policy, model, losses

    plain_policy, plain, plain_losses = run([])
    policy, model, losses = run([ActivationCheckpointing(measure=False)])
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values(),
                                                  strict=True))
    calls = {k: v["calls"] for k, v in policy.census.items()}
    assert calls
    assert calls == {k: v["calls"] for k, v in plain_policy.census.items()}  # the recompute is not counted again


@pytest.mark.parametrize("order", ["compile first", "checkpointing first", "whole model compiled"])
def test_composes_with_torch_compile_in_either_order(tmp_path, recwarn, order):
    modules = None if order == "whole model compiled" else "auto"
    # 13 steps: the price begins after TorchCompile's eager-against-compiled calls (8), one timed trial at a time
    compiled_losses = _fit(tmp_path / "c", "torch_encoder", [TorchCompile(modules=modules, backend="eager")],
                           steps=13)[1]
    checkpointing = ActivationCheckpointing(measure=True, trial_steps=1)
    compiler = TorchCompile(modules=modules, backend="eager")
    callbacks = [checkpointing, compiler] if order == "checkpointing first" else [compiler, checkpointing]
    model, losses = _fit(tmp_path / "ca", "torch_encoder", callbacks, steps=13)
    assert losses == pytest.approx(compiled_losses, rel=1e-5)
    assert checkpointing.checkpointed == ["model.encoder.layers.0", "model.encoder.layers.1"]
    assert compiler.error is None
    # the measurement's on/off steps recompile nothing: the checkpoint wraps the compiled blocks from outside (or,
    # with the whole model compiled, is traced inside it); no recompile-limit warning
    assert not [w for w in recwarn if "compiled versions" in str(w.message)]
    assert checkpointing.price is not None
    assert checkpointing.price.cut >= 0.4
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_teardown_after_an_exception_leaves_the_model_as_it_was(tmp_path):
    model = build("torch_encoder")
    before = snapshot(model)

    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    trainer = pl.Trainer(accelerator="cpu", max_steps=5, logger=False, callbacks=[ActivationCheckpointing(), Boom()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, model.loader(n=48))
    assert snapshot(model) == before
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("kwargs, match", [(dict(save=["matmull"]), "matmull"), (dict(save="matmul"), "save"),
                                               (dict(modules="all"), "modules"), (dict(trial_steps=0), "trial_steps")])
def test_bad_configuration_is_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)


def test_a_model_without_blocks_is_told_to_name_them(tmp_path):
    from helpers import TinyNet, make_loader

    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[ActivationCheckpointing()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="found no repeated blocks"):
        trainer.fit(TinyNet(), make_loader())


assert CASES  # the zoo is importable here


def test_a_recompute_runs_the_code_its_forward_ran_in_speed_trials_and_census_steps(tmp_path):
    # TorchCompile's speed trial runs some calls eagerly, and a census step runs the step under a forced eager stance
    # that ends before backward: the checkpoint's recompute must run eager code there too (aot_eager saves other
    # tensors than eager code does, and the checkpoint checks that it saved the same)
    def callbacks(checkpointing):
        return [PrecisionPolicy(census_every_n_steps=2, measure=False),
                *([ActivationCheckpointing(measure=False)] if checkpointing else []),
                TorchCompile(modules="auto", backend="aot_eager")]

    without = callbacks(False)
    if policy_refused_under("aot_eager"):
        with pytest.raises(ValueError, match=REFUSED):
            _fit(tmp_path / "c", "torch_encoder", without, steps=16)
        return
    _, plain = _fit(tmp_path / "c", "torch_encoder", without, steps=16)
    first = callbacks(True)
    _, losses = _fit(tmp_path / "ca", "torch_encoder", first, steps=16)
    assert losses == pytest.approx(plain, rel=1e-5)
    # and the recompute compiles nothing of its own (the policy's mode, traced in, must not guard on it)
    assert first[2].watch.compiles == without[1].watch.compiles
    assert first[2].regions["model.encoder.layers.0"].speedup is not None  # the trial ran, eager calls included
    assert first[0].census  # census steps ran


@pytest.mark.parametrize("save", [None, ["matmul"]])
@pytest.mark.parametrize("name", list(CASES))
def test_census_steps_inside_checkpointed_blocks_change_nothing(tmp_path, name, save):
    # A census step recomputes 16-bit ops in fp32 beside the model: inside a checkpointed block that bookkeeping must
    # neither be cached by the selective checkpoint (its outputs came back out of order in the recompute) nor saved
    # for backward, and an in-place op (ReLU(inplace=True)) must not be run again in place on the caller's input.
    def policy(census):
        return PrecisionPolicy(rules={"matmul": "bf16", "activation": "bf16"}, measure=False,
                               census_every_n_steps=census)

    blocks = ["model." + CASES[name].blocks]
    quiet, quiet_losses = _fit(tmp_path / "no_census", name, [ActivationCheckpointing(modules=blocks, save=save,
                                                                                      measure=False), policy(0)],
                               steps=3)
    counted = policy(1)
    model, losses = _fit(tmp_path / "census", name, [ActivationCheckpointing(modules=blocks, save=save,
                                                                             measure=False), counted], steps=3)
    assert losses == quiet_losses  # bit for bit: the census only watched
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), quiet.state_dict().values(),
                                                  strict=True))
    assert any(dtype == "bf16" for _, dtype in counted.census)  # and it did watch: the 16-bit rows it recorded


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_whole_model_compile_governs_and_checkpoints_batchnorm_blocks(tmp_path, backend):
    # Traced whole, a checkpointed block is a higher-order operator the policy's mode used to hand on unentered
    # (its convolution met a bf16 input and fp32 weights); under the "eager" backend a traced checkpoint that updates
    # BatchNorm's buffers fails in backward, so those blocks are checkpointed outside the graph instead.
    def callbacks(compiled):
        policy = PrecisionPolicy(rules={"conv": "bf16"}, measure=False, census_every_n_steps=0)
        checkpointing = ActivationCheckpointing(modules=["model.layers.*"], measure=False)
        return [policy, checkpointing, *([TorchCompile(backend=backend, fallback=False)] if compiled else [])]

    eager_model, eager_losses = _fit(tmp_path / "eager", "bn_cnn", callbacks(False), steps=4)
    compiled = callbacks(True)
    if policy_refused_under(backend):
        with pytest.raises(ValueError, match=REFUSED):
            _fit(tmp_path / "compiled", "bn_cnn", compiled, steps=4)
        return
    model, losses = _fit(tmp_path / "compiled", "bn_cnn", compiled, steps=4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    assert compiled[2].watch.frames > 0
    assert compiled[1].untraced == (["model.layers.0", "model.layers.1"] if backend == "eager" else [])
    assert ("outside the compiled graph" in compiled[1].summary_lines()[0]) == (backend == "eager")
    for name, buffer in model.named_buffers():  # BatchNorm's statistics updated once per step, as eagerly
        torch.testing.assert_close(buffer, dict(eager_model.named_buffers())[name], rtol=1e-5, atol=1e-6)


def test_a_graph_break_around_a_compiled_checkpoint_recomputes_in_the_forward_dtypes(tmp_path):
    # The memory view's saved-tensor hooks make dynamo run a traced checkpoint call eagerly; its recompute then ran
    # the block's Python without the policy's mode (fp32 where the forward ran bf16) and backward failed.
    def callbacks(windows):
        return [PrecisionPolicy(rules={"matmul": "bf16"}, measure=False, census_every_n_steps=5),
                *([ProfilerWindows(every_n_steps=3, warmup=0, active=1, memory_breakdown=True)] if windows else []),
                ActivationCheckpointing(modules=["model.blocks.*"], measure=False), TorchCompile(backend="eager")]

    _, plain = _fit(tmp_path / "plain", "torch_mha", callbacks(False), steps=6)
    _, losses = _fit(tmp_path / "probed", "torch_mha", callbacks(True), steps=6)
    assert losses == plain


def _autocast_level() -> int:
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_recompute_stopped_early_inside_a_compiled_region_leaves_autocast_as_it_was(tmp_path, precision):
    # A compiled region enters and leaves autocast as two graph calls (the policy's casts run with autocast off); the
    # checkpoint's recompute stops early between them, and each step left one autocast level entered: autocast then
    # never dropped its cache of cast weights, and a later bf16-mixed run computed with stale ones.
    callbacks = [PrecisionPolicy(measure=False, census_every_n_steps=0),
                 TorchCompile(backend="eager", modules=["model.transformer.h.*"]),
                 ActivationCheckpointing(modules=["model.transformer.h.*"], measure=False)]
    _fit(tmp_path, "hf_gpt2", callbacks, steps=4, precision=precision)
    assert _autocast_level() == 0
    assert not torch.is_autocast_enabled("cpu")


def test_the_price_is_measured_after_three_warm_up_steps_and_on_a_resumed_run(tmp_path):
    class Arms(pl.Callback):  # which steps ran with checkpointing on: a block's forward patched and enabled
        def __init__(self, callback):
            self.callback, self.seen = callback, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append((trainer.global_step, [r.enabled for r in self.callback._regions]))

    checkpointing = ActivationCheckpointing(modules=["model.transformer.h.*"], measure=True, trial_steps=2)
    arms = Arms(checkpointing)
    _fit(tmp_path / "first", "hf_gpt2", [checkpointing, arms], steps=10)
    assert checkpointing.price is not None
    # three warm-up steps with it, one step each way counting bytes, then timed: with, without, without, with; then on
    # with it
    assert [all(e) for _, e in arms.seen] == [True, True, True, True, False, True, False, False, True, True]
    # a run resumed past those steps measures at its own start, as a fresh one does
    model = build("hf_gpt2")
    first = pl.Trainer(accelerator="cpu", max_steps=10, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    first.fit(model, model.loader(n=48))
    first.save_checkpoint(tmp_path / "at10.ckpt")
    resumed = ActivationCheckpointing(modules=["model.transformer.h.*"], measure=True, trial_steps=1)
    again = pl.Trainer(accelerator="cpu", max_steps=17, logger=False, enable_checkpointing=False, callbacks=[resumed],
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    again.fit(build("hf_gpt2"), model.loader(n=48), ckpt_path=str(tmp_path / "at10.ckpt"))
    assert resumed.price is not None
    assert resumed.price.saved_with < resumed.price.saved_without


class BlockCalls(pl.Callback):
    """Counts, per training step, how often each GPT-2 block's first LayerNorm began: twice where the block's checkpoint
    recomputed it in backward, once where the step ran without checkpointing (pre-hooks of the test's own, inside the
    blocks: the checkpoint calls the block's own forward, so a hook on the block sees one call either way, and a
    recompute stops early, once it has what backward needs, so a hook at a block's end may not see it)."""

    def __init__(self):
        self.per_step: list[int] = []
        self._handles = []

    def on_train_start(self, trainer, pl_module):
        def count(module, args):
            self.per_step[-1] += 1

        self._handles = [b.ln_1.register_forward_pre_hook(count) for b in pl_module.model.transformer.h]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.per_step.append(0)

    def on_train_end(self, trainer, pl_module):
        for handle in self._handles:
            handle.remove()


@pytest.mark.parametrize("measure", [False, True])
def test_by_default_no_step_runs_without_checkpointing(tmp_path, measure):
    """Pricing runs steps without the protection the user asked for: only with measure=True."""
    blocks = len(build("hf_gpt2").model.transformer.h)
    calls = BlockCalls()
    checkpointing = ActivationCheckpointing(**({"measure": True, "trial_steps": 2} if measure else {}))
    _fit(tmp_path, "hf_gpt2", [checkpointing, calls], steps=10)
    unprotected = [i for i, n in enumerate(calls.per_step) if n < 2 * blocks]
    assert len(calls.per_step) == 10
    assert all(n in (blocks, 2 * blocks) for n in calls.per_step), calls.per_step
    if measure:
        assert len(unprotected) == 3  # the step counting the bytes without it, the two timed without it
        assert checkpointing.price is not None
    else:
        assert unprotected == []
        assert checkpointing.price is None
        assert "price not measured" in checkpointing.summary_lines()[0]


def test_timed_steps_count_nothing_so_the_count_does_not_price_itself(tmp_path):
    """The count of saved bytes is a pack hook on every tensor autograd saves: on the example ViT it cost the steps
    without checkpointing (13 MB saved) far more than those with it (1.3 MB), and the price read checkpointing as 13%
    faster (x0.87 in the demo, steps of 140-160 ms where a step takes 30). Bytes are counted on one step each way;
    the timed steps run with no saved-tensor hook at all (torch's own hook stack, read before the callback's
    on_before_backward)."""

    class Hooked(pl.Callback):
        def __init__(self):
            self.steps = []

        def on_before_backward(self, trainer, pl_module, loss):
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                self.steps.append(trainer.global_step)

    hooked = Hooked()
    checkpointing = ActivationCheckpointing(modules=["model.transformer.h.*"], measure=True, trial_steps=2)
    _fit(tmp_path, "hf_gpt2", [hooked, checkpointing], steps=10)
    assert checkpointing.price is not None
    assert hooked.steps == [3, 4]  # after three warm-up steps, the two counting steps only
    assert 0 < checkpointing.price.saved_with < checkpointing.price.saved_without


def test_a_timed_step_ends_at_its_batch_end_not_after_the_validation_that_follows(tmp_path):
    """A step's time ran from its batch's start to the next one's: the last batch of an epoch then held the whole
    validation loop. Here the validation sleeps a second and the first timed step is an epoch's last."""
    import time

    from helpers import TinyNet, make_loader

    class SlowValidation(TinyNet):
        def validation_step(self, batch, batch_idx):
            time.sleep(1.0)

    checkpointing = ActivationCheckpointing(modules=["body"], measure=True, trial_steps=1)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=6, limit_val_batches=1, logger=False,
                         callbacks=[checkpointing], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(SlowValidation(), make_loader(), make_loader())
    price = checkpointing.price
    assert price is not None  # warm-up 0-2, counted 3-4, timed 5 (the epoch's last, with) and 6 (without)
    assert price.step_s_with < 1.0, price  # the step alone, not the second of validation after it


def test_a_recompute_runs_the_code_its_forward_ran_when_its_blocks_verdict_lands_mid_step(tmp_path):
    """Identical blocks share one speed trial: the call that ends it (the last block's) can switch the earlier blocks
    to eager after their forwards ran compiled in the same step. Their recomputes in backward must still run what the
    forwards ran (aot_eager saves other tensors than eager code, and the checkpoint checks it saved the same)."""
    import time

    from torch._dynamo import register_backend
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def slow_compiler(gm, example_inputs):
        def run(*args):
            time.sleep(0.02)  # compiled 20 ms a call: measured slower than eager, busy machine or not
            return gm(*args)

        return make_boxed_func(run)

    register_backend(aot_autograd(fw_compiler=slow_compiler), name="opkit_test_slow_aot")
    compiler = TorchCompile(modules="auto", backend="opkit_test_slow_aot")
    checkpointing = ActivationCheckpointing(measure=False)
    _, losses = _fit(tmp_path, "torch_encoder", [compiler, checkpointing], steps=10)
    regions = list(compiler.regions.values())
    assert len(regions) == 2
    assert all(r.slower for r in regions)  # one verdict for both, reached inside a step
    assert len(losses) == 10
