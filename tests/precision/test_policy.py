import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet, make_loader, read_events, snapshot, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_opkit.precision.census import Census
from lightning_opkit.precision.policy import PrecisionPolicy


class Probe(pl.LightningModule):
    """Records the dtype each kind of op produced, with functional calls inside user code."""

    def __init__(self, scale: float = 1.0, fail_at: int = -1):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.inner = nn.Sequential(nn.Linear(16, 16))
        self.w = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.head = nn.Linear(16, 4)
        self.scale = scale
        self.fail_at = fail_at
        self.seen: dict[str, torch.dtype] = {}
        self.peaks: dict[str, float] = {}

    def forward(self, x):
        h = self.body(x * self.scale)
        n = F.layer_norm(h, (16,))
        s = F.softmax(n, dim=-1)
        a = F.gelu(s * 10)
        m = a @ self.w
        i = self.inner(m)
        out = self.head(i)
        self.seen.update(linear=h.dtype, norm=n.dtype, softmax=s.dtype, gelu=a.dtype, matmul=m.dtype,
                         inner=i.dtype, head=out.dtype)
        self.peaks["norm"] = max(self.peaks.get("norm", 0.0), float(n.detach().abs().max()))
        return out

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.seen["loss"] = loss.dtype
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


BF, FP = torch.bfloat16, torch.float32
DEFAULT = dict(linear=BF, norm=FP, softmax=FP, gelu=BF, matmul=BF, inner=BF, head=BF, loss=FP)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_default_table_gives_the_same_dtypes_under_every_trainer_precision(tmp_path, precision):
    model = Probe()
    trainer(tmp_path, [PrecisionPolicy()], max_steps=2, precision=precision).fit(model, make_loader())
    assert model.seen == DEFAULT
    param_dtype = {"32-true": FP, "bf16-mixed": FP, "bf16-true": BF, "16-true": torch.float16}[precision]
    assert {p.dtype for p in model.parameters()} == {param_dtype}  # parameters keep their own dtype


def test_without_policy_autocast_decides(tmp_path):
    model = Probe()
    trainer(tmp_path, [], max_steps=1, precision="bf16-mixed").fit(model, make_loader())
    assert model.seen["norm"] == BF
    assert model.seen["softmax"] == BF


def test_class_rules_and_module_overrides(tmp_path):
    model = Probe()
    policy = PrecisionPolicy(rules={"matmul": "fp32", "norm": "bf16", "activation": "keep"},
                             overrides={"inner": "bf16", "head": "fp32"})
    trainer(tmp_path, [policy], max_steps=1).fit(model, make_loader())
    assert model.seen == dict(linear=FP, norm=BF, softmax=FP, gelu=FP, matmul=FP, inner=BF, head=FP, loss=FP)


def test_innermost_module_rule_wins(tmp_path):
    model = Probe()
    policy = PrecisionPolicy(rules={"matmul": "fp32"}, overrides={"inner": "fp32", "inner.0": "bf16"})
    trainer(tmp_path, [policy], max_steps=1).fit(model, make_loader())
    assert (model.seen["inner"], model.seen["head"]) == (BF, FP)
    assert policy.dtype_for("matmul", "inner.0") == "bf16"
    assert policy.dtype_for("matmul") == "fp32"


def test_gradients_reach_every_parameter(tmp_path):
    grads = {}

    class Spy(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.update({n: p.grad for n, p in pl_module.named_parameters()})

    model = Probe()
    trainer(tmp_path, [PrecisionPolicy(), Spy()], max_steps=1).fit(model, make_loader())
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        assert grad is not None, name
        assert grad.dtype == FP, name
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, name


def test_census_in_tensorboard_matches_the_activations(tmp_path):
    model = Probe(scale=3.0)
    policy = PrecisionPolicy(census_every_n_steps=2, overrides={"head": "fp32"}, measure=False)
    trainer(tmp_path, [policy], max_steps=3).fit(model, make_loader())
    scalars, texts = read_events(str(tmp_path))
    steps = [s for s, _ in scalars["opkit/precision/norm/calls"]]
    assert steps == [1, 3]  # census at global steps 0 and 2, logged after their optimizer step
    norm = policy.census[("norm", "fp32")]
    assert norm["calls"] == 1
    assert norm["rel_error"] is None
    assert norm["headroom_bits"] is None
    assert norm["absmax"] == pytest.approx(model.peaks["norm"], rel=1e-6) or norm["absmax"] <= model.peaks["norm"]
    # bf16 has fp32's range: no headroom figure; its risk is lost mantissa, measured against fp32 recomputes
    matmul = policy.census[("matmul", "bf16")]
    assert matmul["calls"] == 3
    assert not matmul["override"]
    assert 1e-4 < matmul["rel_error"] < 2e-2
    assert matmul["underflow_frac"] == 0.0
    assert policy.census[("matmul", "fp32")]["override"]
    assert policy.census[("matmul", "fp32")]["calls"] == 1
    assert scalars["opkit/precision/matmul/rel_error"][-1][1] == pytest.approx(matmul["rel_error"], rel=1e-5)
    assert "opkit/precision/matmul/underflow_frac" in scalars
    assert not [t for t in scalars if t.endswith("headroom_bits")]  # nothing ran in fp16
    assert not [t for t in scalars if t.startswith(("opkit/precision/norm/rel", "opkit/precision/loss/rel"))]
    table = texts["opkit/precision/census"][-1][1]
    assert "| matmul | bf16 | class rule (bf16) | 3 |" in table
    assert "| matmul | fp32 | module override | 1 |" in table
    body = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    errors = [line.split(" | ")[4] for line in body]
    known = [float(e) for e in errors if e != "-"]
    assert known == sorted(known, reverse=True)
    assert errors.index("-") == len(known)
    assert "| softmax | fp32 |" in texts["opkit/precision/policy"][0][1]


def test_census_error_and_underflow_against_an_fp32_recompute():
    x = torch.tensor([1.0, 3.14159, -2.71828, 1e-6, 1e-9, 0.0])
    census = Census()
    census.record("pointwise", x.half(), override=False, ref=x)
    census.record("pointwise", x.bfloat16(), override=True, ref=x)
    census.record("pointwise", x, override=False)  # fp32: counted, no error figure
    rows = {(r.dtype, r.override): r for r in census.rows()}
    half, bf = rows[("fp16", False)], rows[("bf16", True)]
    expected = float((x.half().float() - x).norm() / x.norm())
    assert half.rel_error == pytest.approx(expected, rel=1e-5)
    assert bf.rel_error > 0
    assert half.underflow_frac == pytest.approx(2 / 6)  # 1e-6 is fp16-subnormal, 1e-9 flushes to zero; 0 was zero
    assert bf.underflow_frac == 0.0
    assert bf.headroom_bits is None
    assert half.headroom_bits == pytest.approx(math.log2(65504 / 3.140625), rel=1e-4)
    assert rows[("fp32", False)].rel_error is None
    assert rows[("fp32", False)].calls == 1


class Tiny(pl.LightningModule):
    """Activations around 1e-6: fp16-subnormal, fine in fp32 and bf16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.lin(x * 1e-6) * 1e6, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_fp16_census_charts_headroom_and_underflow(tmp_path):
    model = Tiny()
    policy = PrecisionPolicy(rules={"matmul": "fp16"}, census_every_n_steps=1, measure=False)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    trainer(tmp_path, [policy], max_steps=1, plugins=[plugin]).fit(model, make_loader())
    scalars, _ = read_events(str(tmp_path))
    matmul = policy.census[("matmul", "fp16")]
    assert matmul["underflow_frac"] > 0
    assert matmul["headroom_bits"] > 10
    assert "opkit/precision/matmul/headroom_bits" in scalars
    assert "opkit/precision/norm/headroom_bits" not in scalars


def test_census_off_records_nothing(tmp_path):
    policy = PrecisionPolicy(census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=2).fit(Probe(), make_loader())
    scalars, _ = read_events(str(tmp_path))
    assert not [t for t in scalars if t.startswith("opkit/precision")]
    assert policy.census == {}


def test_census_turned_off_after_construction_records_nothing(tmp_path):
    policy = PrecisionPolicy(census_every_n_steps=1)
    policy.census_every_n_steps = 0  # as a script sets it before fit (the policy's own test of its printed arguments)
    assert not any(policy.loads_step(step) for step in range(4))
    trainer(tmp_path, [policy], max_steps=2).fit(Probe(), make_loader())
    assert policy.census == {}


def test_near_overflow_warns_for_half_classes(tmp_path):
    model = Probe(scale=4000.0)
    policy = PrecisionPolicy(rules={"matmul": "fp16"}, census_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", "cpu")  # fp16 autocast with Lightning's GradScaler, on CPU
    with pytest.warns(UserWarning, match="'matmul' in fp16 is .* bits from overflow"):
        trainer(tmp_path, [policy], max_steps=1, plugins=[plugin]).fit(model, make_loader())
    assert model.seen["linear"] == torch.float16
    assert policy.census[("matmul", "fp16")]["headroom_bits"] < 4


def test_fp16_without_loss_scaling_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match=r"\['matmul'\] in fp16.*precision='16-mixed'"):
        trainer(tmp_path, [PrecisionPolicy(rules={"matmul": "fp16"})], max_steps=1).fit(Probe(), make_loader())
    with pytest.raises(ValueError, match=r"module head"):
        trainer(tmp_path, [PrecisionPolicy(overrides={"head": "fp16"})], max_steps=1, precision="16-true").fit(
            Probe(), make_loader())


class LargeTargets(pl.LightningModule):
    """Regression onto targets of a few hundred: fine in fp32, an fp16 loss overflows (its squares pass 65504)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        target = (y.float() + 1) * 300
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, target.to(pred.dtype))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def test_16_true_goes_non_finite_and_the_policy_keeps_it_finite(tmp_path):
    torch.manual_seed(0)
    plain = LargeTargets()
    trainer(tmp_path / "plain", [], max_steps=8, precision="16-true").fit(plain, make_loader())
    assert not all(math.isfinite(v) for v in plain.losses)
    torch.manual_seed(0)
    governed = LargeTargets()
    trainer(tmp_path / "policy", [PrecisionPolicy()], max_steps=48, precision="16-true", max_epochs=-1).fit(
        governed, make_loader())
    assert all(math.isfinite(v) for v in governed.losses)
    assert sum(governed.losses[-8:]) < 0.75 * sum(governed.losses[:8])  # and it learns


def test_model_untouched_after_teardown_and_after_an_exception(tmp_path):
    model = Probe()
    before = snapshot(model)
    trainer(tmp_path, [PrecisionPolicy(overrides={"head": "fp32"})], max_steps=1).fit(model, make_loader())
    assert snapshot(model) == before
    assert torch._C._len_torch_function_stack() == 0
    failing = Probe(fail_at=1)
    before = snapshot(failing)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [PrecisionPolicy(overrides={"head": "fp32"})], max_steps=3).fit(failing, make_loader())
    assert snapshot(failing) == before
    assert torch._C._len_torch_function_stack() == 0
    assert "training_step" not in vars(failing)


def test_validation_steps_are_governed_too(tmp_path):
    class Val(Probe):
        def validation_step(self, batch, batch_idx):
            self.seen.clear()
            self(batch[0])

    model = Val()
    trainer(tmp_path, [PrecisionPolicy()], max_steps=1, limit_val_batches=1, val_check_interval=1).fit(
        model, make_loader(), make_loader(n=8))
    assert model.seen["norm"] == FP
    assert model.seen["linear"] == BF


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rules={"gemm": "bf16"}), r"unknown op class 'gemm'.*'matmul'"),
        (dict(rules={"norm": "float32"}), r"'float32'.*\['fp32', 'bf16', 'fp16', 'keep'\]"),
        (dict(default="half"), r"`default`.*'half'"),
        (dict(overrides={"head": "fp64"}), r"overrides\['head'\]"),
        (dict(census_every_n_steps=-1), "census_every_n_steps"),
        (dict(rules="auto", whole_step="yes"), r"`whole_step`.*'yes'"),
        (dict(rules="auto", trial_steps=-1), r"`trial_steps`.*-1"),
        (dict(rules="auto", trial_steps=1.5), r"`trial_steps`.*1\.5"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**kwargs)


def test_module_glob_matching_nothing_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match=r"'heads'.*'head'"):
        trainer(tmp_path, [PrecisionPolicy(overrides={"heads": "fp32"})], max_steps=1).fit(Probe(), make_loader())


def test_does_not_invent_a_validation_step(tmp_path):
    # Probe has no validation_step: with a val dataloader, Lightning must still see none and skip validation.
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(trainer.enable_validation)

    model = Probe()
    t = trainer(tmp_path, [PrecisionPolicy(), Spy()], max_steps=2, limit_val_batches=1, val_check_interval=1)
    t.fit(model, make_loader(), make_loader(n=8))
    assert seen == [False, False]
    assert "validation_step" not in vars(model)
    assert t.fit_loop.epoch_loop.val_loop.batch_progress.total.completed == 0


def test_census_counts_a_step_once_even_when_nan_detector_replays_it(tmp_path):
    from helpers import TinyNet

    from lightning_opkit import NaNDetector

    policy = PrecisionPolicy(rules={"matmul": "fp32"}, census_every_n_steps=2)
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [policy, detector], max_steps=3).fit(TinyNet(forward_steps=(2,)), make_loader())
    assert [e["step"] for e in detector.events] == [2]  # step 2 was replayed by the detector
    assert policy.census[("matmul", "fp32")]["calls"] == 2  # body.0 and head, once each


class DropAttention(pl.LightningModule):
    """Attention with dropout inside the op: its fp32 recompute must draw the same mask."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        q, k, v = self.qkv(x).view(2, 4, 3, 8).unbind(2)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        return F.cross_entropy(self.head(h.reshape(8, 8)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_census_recomputes_random_ops_with_their_own_random_numbers(tmp_path):
    runs = {}
    for every in (1, 0):
        torch.manual_seed(0)
        model = DropAttention()
        policy = PrecisionPolicy(rules={"attention": "bf16"}, census_every_n_steps=every, measure=False)
        trainer(tmp_path / str(every), [policy], max_steps=3).fit(model, make_loader())
        runs[every] = (model, policy)
    attention = runs[1][1].census[("attention", "bf16")]
    assert 0 < attention["rel_error"] < 0.02  # another dropout mask would give an error near 1
    # census steps leave the random stream where it was: the same training as without a census
    assert all(torch.equal(a, b) for a, b in zip(runs[1][0].parameters(), runs[0][0].parameters()))


def test_under_16_mixed_the_default_table_lowers_to_fp16_and_mixed_rules_are_refused(tmp_path):
    def fit(policy):
        scaler = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        trainer(tmp_path, [policy], max_steps=1, plugins=[scaler]).fit(TinyNet(), make_loader())

    default = PrecisionPolicy(measure=False, census_every_n_steps=0)
    fit(default)
    assert {default.table[c] for c in ("matmul", "conv", "attention", "activation")} == {"fp16"}
    assert default.table["norm"] == "fp32"
    # the same policy under 32-true keeps the default's bf16 (no autocast to agree with)
    trainer(tmp_path, [default], max_steps=1).fit(TinyNet(), make_loader())
    assert default.table["matmul"] == "bf16"
    with pytest.raises(ValueError, match=r"runs \['matmul'\] in bf16 while Trainer\(precision='16-mixed'\) autocasts"):
        fit(PrecisionPolicy(rules={"matmul": "bf16"}))
    with pytest.raises(ValueError, match=r"\['module head'\] in bf16"):
        fit(PrecisionPolicy(rules={"matmul": "fp16"}, overrides={"head": "bf16"}))


def test_the_built_in_table_under_32_true_lowers_nothing_the_device_lacks_units_for_and_says_so_before_step_1():
    from lightning_opkit.precision.config import fit_table

    emulated = "no native bf16 units (AVX2 only, no avx512_bf16/amx_bf16)"
    with pytest.warns(UserWarning, match=r"the built-in table's bf16 classes \(matmul, conv, attention, activation\)"
                                         r" run in fp32 here"):
        table = fit_table(None, "keep", "32-true", "cpu", hardware=emulated)
    assert {table[c] for c in ("matmul", "conv", "attention", "activation")} == {"fp32"}
    # explicit rules are the user's: kept, and said before step 1
    with pytest.warns(UserWarning, match=r"precision='32-true' \(no autocast\) lowers matmul to bf16"):
        assert fit_table({"matmul": "bf16"}, "keep", "32-true", "cpu", hardware=emulated)["matmul"] == "bf16"
    # under autocast the Trainer's precision was the user's choice: nothing changed, nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_table(None, "keep", "bf16-mixed", "cpu", hardware=emulated)["matmul"] == "bf16"


def test_a_default_policy_under_32_true_says_what_it_lowers_at_setup_before_the_first_step(tmp_path):
    """On this machine, whatever its hardware: the warning comes before the first training step, and names what the
    census then sees in 16-bit."""
    steps = []

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps.append(len(said))

    policy = PrecisionPolicy(census_every_n_steps=1, measure=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer(tmp_path, [policy, FirstStep()], max_steps=1, precision="32-true").fit(Probe(), make_loader())
    notes = [str(w.message) for w in said if "PrecisionPolicy" in str(w.message) and "32-true" in str(w.message)
             or "built-in table" in str(w.message)]
    assert notes
    assert steps[0] >= 1  # said before step 1
    lowered = {c for c, d in policy.table.items() if d == "bf16"}
    assert ("matmul", "bf16") in policy.census or not lowered  # the census saw what the warning said would run
    for cls in lowered:
        assert f"{cls} to bf16" in notes[-1]
