"""Measure, then decide: measure_precision, decide and PrecisionPolicy(rules="auto") on real models and runs."""

import math

import pytest
import torch
from helpers import make_loader, read_events, snapshot, trainer
from torch import nn

from lightning_opkit import PrecisionPolicy, replaying
from lightning_opkit.precision import Measurement, PrecisionMeasurements, decide, measure_precision
from lightning_opkit.precision.candidates import _RETIMES
from lightning_opkit.precision.dtypes import hardware_note
from precision.test_policy import Probe

NO_BF16_UNITS = "no native bf16" in hardware_note("cpu", "bf16")


def _row(cls, dtype="bf16", speed=0.5, loss=1e-4, cos=0.9999, **kw):
    return Measurement(cls, dtype, time_ratio=speed, loss_change=loss, grad_cosine=cos, **kw)


def test_decide_takes_the_fastest_accurate_dtype_and_says_why_not_otherwise():
    rows = [
        _row("matmul", speed=11.2),                       # slower: fp32
        _row("conv", speed=0.4),                          # faster and accurate: bf16
        _row("norm", speed=0.5, loss=0.03),               # faster, loss moves too much: fp32
        _row("softmax", speed=0.5, cos=0.95),             # faster, gradients turn: fp32
        _row("attention", speed=0.6), _row("attention", "fp16", speed=0.3),  # both fine: the faster one
        _row("activation", speed=0.98),                   # 2% faster is within timing noise: fp32
        _row("loss", speed=None, failed="no kernel"),     # could not run: fp32
        _row("pointwise", speed=0.5, loss=None, cos=None),  # error not measured: fp32
    ]
    got = decide(rows, tolerance=0.01)
    assert {c: d.dtype for c, d in got.items()} == {
        "matmul": "fp32", "conv": "bf16", "attention": "fp16", "norm": "fp32", "softmax": "fp32",
        "activation": "fp32", "loss": "fp32", "pointwise": "fp32"}
    assert "11.20x slower" in got["matmul"].reason
    assert "2.50x faster" in got["conv"].reason
    assert "3.00e-02 > tolerance 0.01" in got["norm"].reason
    assert "cosine 0.95000" in got["softmax"].reason
    assert "no kernel" in got["loss"].reason
    assert "error not measured" in got["pointwise"].reason
    assert decide(rows, tolerance=0.05)["norm"].dtype == "bf16"  # a looser tolerance lets it through
    assert decide(rows, dtypes=("bf16",))["attention"].dtype == "bf16"  # fp16 only when offered (loss scaling)


def test_decide_ignores_savings_nobody_would_notice():
    rows = [_row("matmul", speed=0.5, fp32_ms=100.0), _row("reduction", speed=0.5, fp32_ms=0.5)]
    got = decide(rows)
    assert got["matmul"].dtype == "bf16"
    assert got["reduction"].dtype == "fp32"
    assert "would save 0.250 of 100.50 ms" in got["reduction"].reason


@pytest.mark.parametrize("bad", [-0.1, 1.0, "0.01", True])
def test_bad_tolerance_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match=r"`tolerance`.*" + repr(bad).replace(".", r"\.")):
        PrecisionPolicy(rules="auto", tolerance=bad)
    with pytest.raises(ValueError, match=r"'auto', a dict.*'fast'"):
        PrecisionPolicy(rules="fast")


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, [p.grad for p in model.parameters()],
            torch.get_rng_state().clone())


def test_measure_precision_on_a_plain_module_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    before = _state(model)
    table = measure_precision(model, lambda: batch,
                              loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    after = _state(model)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])  # BatchNorm statistics included
    assert after[1] == [None] * len(after[1])
    assert torch.equal(before[2], after[2])
    assert {"matmul", "norm", "activation", "loss"} <= set(table.classes)
    with torch.no_grad():
        fp32_loss = float(nn.functional.cross_entropy(model.train()(batch[0]), batch[1]))
    assert table.loss == pytest.approx(fp32_loss, rel=1e-3)  # dropout's mask differs; BN batch stats do not
    for row in table:
        assert row.failed is None
        assert row.time_ratio > 0
        assert row.fp32_ms > 0
        assert row.calls >= 1
        assert 0 < row.rel_error < 0.05
        assert row.loss_change < 0.1
        assert 0.9 < row.grad_cosine <= 1 + 1e-6
    text = table.table({"matmul": "fp32"})
    assert text.startswith("Measured in ")
    assert "| matmul | bf16 |" in text
    assert "| no |" in text


def test_measure_precision_refuses_a_model_without_a_loss_and_bad_arguments():
    with pytest.raises(ValueError, match="scalar loss.*loss_fn"):
        measure_precision(nn.Linear(4, 4), lambda: torch.randn(2, 4))
    with pytest.raises(ValueError, match="'fp64'"):
        measure_precision(nn.Linear(4, 4), lambda: torch.randn(2, 4), dtypes=["fp64"])
    with pytest.raises(ValueError, match="'gemm'"):
        measure_precision(nn.Linear(4, 4), lambda: torch.randn(2, 4), classes=["gemm"])


def test_speeds_are_cached_per_shape_within_the_process():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    batch = torch.randn(32, 64)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    first = measure_precision(model, lambda: batch, loss_fn=loss, errors=False)
    second = measure_precision(model, lambda: batch, loss_fn=loss, errors=False)
    assert [r.time_ratio for r in first] == [r.time_ratio for r in second]  # the same shapes are not timed again
    assert all(r.rel_error is None for r in second)


def test_auto_on_this_cpu_follows_the_measured_speed(tmp_path):
    model = Probe()
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=1)
    trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    choice = policy.choice
    best = choice.best
    # The fastest table within tolerance, or one within 2% of it that is closer to fp32 (its own figures say so).
    good = [r for r in choice.runs if r.within(policy.tolerance)]
    assert best in good
    assert best.ms <= 1.02 * min(r.ms for r in good)
    assert all(r.error >= best.error for r in good if r.ms <= 1.02 * min(g.ms for g in good))
    # plain autocast chosen: every class left to autocast ("keep")
    assert {c: d.dtype for c, d in policy.decisions.items()} == (best.table or dict.fromkeys(policy.decisions, "keep"))
    # the fp32 reference is always timed again, in every round, like the close contenders
    assert len(choice.runs[0].samples) == 1 + _RETIMES
    assert all(1 <= len(r.samples) <= 1 + _RETIMES for r in choice.runs if r.ms is not None)
    matmul = policy.measurements.get("matmul", "bf16")
    if NO_BF16_UNITS and matmul.time_ratio > 3:
        # bf16 GEMMs emulated and measured far slower (~11x on an AVX2 Xeon): no table lowering them is even run.
        # At tiny widths the emulation can cost little (1.3x on an AVX2 EPYC): then the runs decide, as above.
        assert best.table.get("matmul", "fp32") == "fp32"
        assert all(r.skipped for r in choice.runs[1:] if r.table.get("matmul") == "bf16" or r.autocast)
    fixed = {cls: policy.table[cls] for cls in ("matmul", "norm", "softmax", "loss") if policy.table[cls] != "keep"}
    seen = {"matmul": model.seen["matmul"], "norm": model.seen["norm"], "softmax": model.seen["softmax"],
            "loss": model.seen["loss"]}
    assert {c: {"fp32": torch.float32, "bf16": torch.bfloat16}[d] for c, d in fixed.items()} == {
        c: seen[c] for c in fixed}
    _, texts = read_events(str(tmp_path))
    sensitivity = texts["opkit/precision/sensitivity"][0][1]
    assert "| matmul | bf16 |" in sensitivity
    assert "cpu" in sensitivity
    assert "| gemm+keep |" in sensitivity
    decision = texts["opkit/precision/decision"][0][1]
    assert f"| matmul | {policy.table['matmul']} |" in decision
    assert "tolerance 0.01" in decision
    assert f"chosen table '{best.name}'" in decision
    autocast = choice.autocast
    if best is not autocast and autocast.ms is not None:  # else it was predicted slower and not run, or chosen
        assert "plain bf16-mixed on the same rows" in decision
    else:
        assert best is autocast or "predicted" in autocast.skipped
    lines = policy.summary_lines()
    assert any("auto, measured in" in line for line in lines)
    assert any(f"chosen table '{best.name}'" in line and "grad cosine" in line for line in lines)


class Injected(PrecisionPolicy):
    """The policy with measurements given instead of taken: both branches of a decision on any machine."""

    def __init__(self, rows, **kwargs):
        super().__init__(rules="auto", **kwargs)
        self.rows = rows
        # rules="auto"'s Trainer-free part measures (and, in Chosen, chooses) through these instead.
        self._auto._measure = self._measure
        if hasattr(self, "_choose"):
            self._auto._choose = self._choose

    def _measure(self, model, batch, loss_fn, **kwargs):
        return PrecisionMeasurements(self.rows, device="injected", loss=1.0, seconds=0.0)


def test_auto_runs_each_class_in_the_decided_dtype(tmp_path):
    model = Probe()
    rows = [_row("matmul", speed=0.3), _row("norm", speed=0.5, loss=0.2), _row("activation", speed=2.0),
            _row("softmax", speed=0.5), _row("loss", speed=1.0)]
    policy = Injected(rows, census_every_n_steps=1, whole_step=False)  # per-class decisions, as given
    trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    bf, fp = torch.bfloat16, torch.float32
    assert model.seen == dict(linear=bf, norm=fp, softmax=bf, gelu=fp, matmul=bf, inner=bf, head=bf, loss=fp)
    assert policy.census[("matmul", "bf16")]["rel_error"] > 0
    _, texts = read_events(str(tmp_path))
    assert "| matmul | bf16 | 3.33x faster than fp32" in texts["opkit/precision/decision"][0][1]
    assert "| norm | fp32 |" in texts["opkit/precision/policy"][-1][1]


def test_auto_re_measures_every_n_steps(tmp_path):
    policy = PrecisionPolicy(rules="auto", remeasure_every_n_steps=2, census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=5).fit(Probe(), make_loader())
    scalars, _ = read_events(str(tmp_path))
    assert [s for s, _ in scalars["opkit/precision/measure_s"]] == [0, 2, 4]
    assert all(v > 0 for _, v in scalars["opkit/precision/measure_s"])
    assert scalars["opkit/precision/measure_s"][-1][1] == pytest.approx(policy.measure_seconds, rel=1e-6)


def test_explicit_rules_warn_once_when_a_dtype_is_measured_slower(tmp_path, recwarn):
    policy = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=3).fit(Probe(), make_loader())
    slow = [str(w.message) for w in recwarn if "slower than fp32" in str(w.message)]
    matmul = policy.measurements.get("matmul", "bf16")
    assert matmul.rel_error is None  # speed only: explicit rules are not second-guessed on accuracy
    # One warning at most, naming every slow class; the built-in table also lowers activation, which may be slow too.
    assert len(slow) <= 1
    if matmul.time_ratio > 1.05:
        assert len(slow) == 1
        assert f"bf16 matmul is {matmul.time_ratio:.2f}x slower than fp32" in slow[0]
        assert "measure=False" in slow[0]
        assert "rules='auto'" in slow[0]
        if NO_BF16_UNITS:
            assert "no native bf16 units" in slow[0]
    else:
        assert not any("bf16 matmul is" in w for w in slow)
    recwarn.clear()
    quiet = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=0, measure=False)
    trainer(tmp_path / "quiet", [quiet], max_steps=1).fit(Probe(), make_loader())
    assert quiet.measurements is None
    assert not [w for w in recwarn if "slower than fp32" in str(w.message)]


@pytest.mark.parametrize("winner", ["measured", "autocast"])
def test_measurement_leaves_the_training_run_unchanged(tmp_path, monkeypatch, winner):
    # Whatever it decides (fp32 on a machine without bf16 units, a table, or plain autocast, which timings on a busy
    # machine can make win: that branch is forced here too, so the test does not depend on the machine's load), a run
    # that measured first trains exactly like one that ran the decision from the start: no RNG, buffer or gradient
    # left behind.
    if winner == "autocast":
        from lightning_opkit.precision import auto as auto_module

        measured_choice = auto_module.choose_table

        def autocast_wins(*args, **kwargs):
            choice = measured_choice(*args, **kwargs)
            return choice.confirmed(next(r.name for r in choice.runs if r.autocast), "forced by the test")

        monkeypatch.setattr(auto_module, "choose_table", autocast_wins)
    torch.manual_seed(0)
    measured = Probe()
    # trial_steps=0: trial steps train on each contender table on purpose; here only the measurement is compared
    auto = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    trainer(tmp_path / "a", [auto], max_steps=3).fit(measured, make_loader())
    torch.manual_seed(0)
    plain = Probe()
    if auto.choice.best.autocast:  # plain autocast chosen: compare with plain bf16-mixed
        trainer(tmp_path / "b", [], max_steps=3, precision="bf16-mixed").fit(plain, make_loader())
    else:
        rules = {c: d for c, d in auto.table.items() if c in auto.decisions}
        fixed = PrecisionPolicy(rules=rules, default="fp32", census_every_n_steps=0, measure=False)
        trainer(tmp_path / "b", [fixed], max_steps=3).fit(plain, make_loader())
    assert snapshot(measured) == snapshot(plain)
    differ = [n for (n, a), b in zip(measured.named_parameters(), plain.parameters()) if not torch.equal(a, b)]
    assert differ == [], (differ, auto.table, auto.choice.table() if auto.choice else None)
    assert math.isfinite(auto.measurements.seconds)


class Manual(Probe):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.steps_taken = 0

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if not replaying():
            self.steps_taken += 1


def test_manual_optimization_is_measured_without_stepping(tmp_path):
    model = Manual()
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    run = trainer(tmp_path, [policy], max_steps=3)
    run.fit(model, make_loader())
    assert model.steps_taken == 3
    assert run.global_step == 3
    assert policy.measurements is not None
    assert policy.measurements.rows


class FailsOnce(Probe):
    """A step that raises the first time it ever runs (the measurement's fp32 reference run)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def training_step(self, batch, batch_idx):
        self.runs += 1
        if self.runs == 1:
            raise RuntimeError("a user invariant")
        return super().training_step(batch, batch_idx)


def test_a_failing_measurement_warns_and_training_goes_on_in_fp32(tmp_path):
    model = FailsOnce()
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    with pytest.warns(UserWarning, match="could not measure this model \\(RuntimeError: a user invariant\\).*fp32"):
        trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    assert model.trainer.global_step == 2
    assert policy.measurements is None
    assert policy.decisions == {}
    assert model.seen["matmul"] == torch.float32
    assert model.seen["norm"] == torch.float32


def test_a_lowered_run_that_fails_is_that_rows_failure_and_fp32():
    runs = []

    def loss_fn(model, batch):
        runs.append(1)
        if len(runs) == 2:  # the first lowered run
            raise RuntimeError("no kernel for this")
        return model(batch).square().mean()

    table = measure_precision(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), lambda: torch.randn(4, 8),
                              loss_fn=loss_fn)
    failed = [r for r in table if r.failed]
    assert len(failed) == 1
    assert "no kernel for this" in failed[0].failed
    assert failed[0].time_ratio is not None
    assert decide(table)[failed[0].op_class].dtype == "fp32"
    assert all(r.grad_cosine is not None for r in table if not r.failed)


class WrittenInBf16(Probe):
    """User code that runs one GEMM in bf16 on purpose."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen["explicit"] = (x.bfloat16() @ self.body.weight.T.bfloat16()).dtype
        return super().training_step(batch, batch_idx)


def test_auto_with_nothing_to_lower_stands_aside_and_the_model_runs_as_written(tmp_path):
    model = WrittenInBf16()
    auto = Injected([_row("matmul", speed=2.0), _row("norm", speed=1.5)], census_every_n_steps=3)
    trainer(tmp_path, [auto], max_steps=2).fit(model, make_loader())
    assert set(auto.table[c] for c in auto.decisions) == {"fp32"}
    assert auto._governor.passthrough
    assert model.seen["explicit"] == torch.bfloat16  # not upcast: the policy found nothing worth lowering
    assert auto.census == {}  # it ran nothing, so it counts nothing (census steps included)
    assert any("stands aside" in line for line in auto.summary_lines())
    _, texts = read_events(str(tmp_path))
    assert "stands aside" in texts["opkit/precision/decision"][0][1]
    fixed = PrecisionPolicy(rules={"matmul": "fp32"}, census_every_n_steps=0, measure=False)
    trainer(tmp_path / "fixed", [fixed], max_steps=1).fit(model, make_loader())
    assert model.seen["explicit"] == torch.float32  # explicit rules decide every op, user-made bf16 included
