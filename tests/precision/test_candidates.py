"""rules="auto" decides for the whole step: candidate tables run on the real step, timed, their error measured as a
whole, beside plain bf16-mixed; and the defects the whole-step work found (speed check, autocast-off regions)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import make_loader, read_events, trainer
from torch import nn

from lightning_opkit import PrecisionPolicy, replaying
from lightning_opkit.core.trial import Trial
from lightning_opkit.precision.auto import describe_trial
from lightning_opkit.precision.candidates import (
    AUTOCAST,
    StepChoice,
    TableRun,
    _pick,
    candidate_tables,
    choose_table,
    first_rows,
)
from lightning_opkit.precision.decide import TIE
from lightning_opkit.precision.op_timing import time_classes
from lightning_opkit.precision.runner import StepRunner, record_ops
from precision.test_auto import Injected, _row
from precision.test_policy import Probe

BF, FP = torch.bfloat16, torch.float32


def test_candidates_cover_fp32_gemm_keep_the_pick_and_the_pick_with_keep():
    classes = ["matmul", "attention", "norm", "activation", "pointwise", "loss"]
    tables = candidate_tables({"matmul": "bf16", "activation": "bf16", "norm": "fp32"}, classes)
    assert list(tables) == ["fp32", "gemm+keep", "per-class", "per-class+keep"]
    assert set(tables["fp32"].values()) == {"fp32"}
    assert tables["gemm+keep"] == {"matmul": "bf16", "attention": "bf16", "norm": "fp32", "activation": "keep",
                                   "pointwise": "keep", "loss": "fp32"}
    assert tables["per-class"]["attention"] == "fp32"
    assert tables["per-class"]["activation"] == "bf16"
    # ``keep`` replaces fp32 only where a class is neither precision-sensitive (norm, loss) nor a GEMM (attention)
    assert tables["per-class+keep"] == {"matmul": "bf16", "attention": "fp32", "norm": "fp32", "activation": "bf16",
                                        "pointwise": "keep", "loss": "fp32"}
    # nothing lowered class by class: "per-class" is the fp32 table, and ``keep`` over nothing lowered is no candidate
    assert list(candidate_tables({}, classes)) == ["fp32", "gemm+keep"]
    assert candidate_tables({}, ["matmul"], low="fp16")["gemm+keep"] == {"matmul": "fp16"}


def _run(name, ms, loss=0.0, cos=1.0, **kw):
    return TableRun(name, {}, ms=ms, loss_change=loss, grad_cosine=cos, samples=[ms], **kw)


def test_the_fastest_table_within_tolerance_wins_and_a_tie_goes_to_the_closer_to_fp32():
    runs = [_run("fp32", 100.0), _run("a", 60.0, loss=0.05), _run("b", 70.0, loss=1e-4), _run("c", 71.0, loss=1e-6)]
    assert _pick(runs, 0.01) == "c"  # a is out of tolerance; c is within 2% of b and closer to fp32
    assert _pick(runs, 0.1) == "a"
    runs[3].ms = 75.0
    assert _pick(runs, 0.01) == "b"  # 7% slower is no tie
    assert _pick([_run("fp32", 100.0), _run("x", 50.0, cos=0.9)], 0.01) == "fp32"  # gradients turned: fp32
    assert _pick([_run("fp32", 100.0), TableRun("y", {}, skipped="predicted 9.0x slower")], 0.01) == "fp32"
    # under compile, plain autocast takes a tie at the smallest error (the same numerics), and only then
    tied = [_run("fp32", 100.0), _run("gemm+keep", 50.0, loss=1e-5), _run("autocast", 50.5, loss=1e-5, autocast="bf16")]
    assert _pick(tied, 0.01) == "gemm+keep"
    assert _pick(tied, 0.01, autocast_wins_ties=True) == "autocast"
    tied[2].loss_change = 2e-5
    assert _pick(tied, 0.01, autocast_wins_ties=True) == "gemm+keep"  # autocast further from fp32: no


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def test_choose_table_runs_each_candidate_on_the_step_beside_autocast_and_leaves_no_trace():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randn(16, 16)
    runner = StepRunner(model, batch, lambda m, b: m(b).square().mean())
    with runner.session():
        log, _, _ = record_ops(runner)
        rows = time_classes(log, torch.device("cpu"), ["bf16"], reps=1)
        tables = candidate_tables({}, sorted({r.op_class for r in rows}))
        choice = choose_table(runner, tables, rows, tolerance=0.01, batch_rows=16)
    assert [r.name for r in choice.runs] == [*tables, AUTOCAST]
    for run in [*choice.runs, choice.autocast]:
        if run.skipped is None:
            assert run.ms > 0, run
            assert run.loss_change is not None, run
            assert 0.99 < run.grad_cosine <= 1 + 1e-6, run
    assert choice.runs[0].loss_change == 0.0
    assert choice.autocast.name == AUTOCAST
    assert choice.best.within(0.01)
    assert choice.chosen in [*tables, AUTOCAST]
    text = choice.table()
    assert "| gemm+keep |" in text
    assert "| autocast | plain torch.autocast in bf16" in text
    assert "16 row(s)" in text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_table_predicted_far_slower_is_not_run():
    # On a CPU without native bf16 units a bf16 GEMM is ~10x slower: no whole step is spent finding that out again.
    model = _model()
    runner = StepRunner(model, torch.randn(8, 16), lambda m, b: m(b).square().mean())
    rows = [_row("matmul", speed=12.0, fp32_ms=5.0), _row("norm", speed=1.5, fp32_ms=0.5),
            _row("activation", speed=1.2, fp32_ms=0.5)]
    with runner.session():
        choice = choose_table(runner, candidate_tables({}, ["matmul", "norm", "activation"]), rows, 0.01, 8)
    gemm = next(r for r in choice.runs if r.name == "gemm+keep")
    assert gemm.ms is None
    assert "predicted" in gemm.skipped
    assert "slower" in gemm.skipped
    assert choice.chosen == "fp32"
    assert "predicted" in choice.autocast.skipped


def test_first_rows_slices_every_tensor_with_the_batch_dimension():
    x, y, mask = torch.randn(64, 3), torch.arange(64), torch.ones(3, 3)
    (sx, sy, smask), n = first_rows((x, y, mask))
    assert n == 8
    assert sx.shape == (8, 3)
    assert torch.equal(sy, y[:8])
    assert smask.shape == (3, 3)
    small, n = first_rows({"ids": torch.zeros(4, 7)})
    assert n == 1
    assert small["ids"].shape == (1, 7)


class Chosen(Injected):
    """rules="auto" with the per-class measurements and the whole-step choice given: both branches anywhere."""

    def __init__(self, rows, pick, others_ms=200.0, autocast_ms=91.0, **kwargs):
        super().__init__(rows, **kwargs)
        self.pick, self.others_ms, self.autocast_ms = pick, others_ms, autocast_ms

    def _choose(self, model, batch, loss_fn, rows, per_class, dtypes, agree, compiled):
        self.candidates = candidate_tables(per_class, sorted(per_class), "bf16")
        runs = [TableRun(name, table, ms=300.0 if name == "fp32" else 90.0 if name == self.pick else self.others_ms,
                         loss_change=0.0 if name == "fp32" else 1e-5, grad_cosine=1.0 if name == "fp32" else 0.9999)
                for name, table in self.candidates.items()]
        runs.append(TableRun(AUTOCAST, {}, ms=self.autocast_ms, loss_change=2e-5, grad_cosine=0.9998,
                             autocast="bf16"))
        return StepChoice(runs, _pick(runs, self.tolerance), rows=1, seconds=0.1, tolerance=self.tolerance)


def test_auto_trains_with_the_chosen_whole_step_table(tmp_path):
    model = Probe()
    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("norm", speed=1.3, loss=None, cos=None),
            _row("softmax", speed=1.2, loss=None, cos=None), _row("activation", speed=0.9, loss=None, cos=None),
            _row("loss", speed=1.1, loss=None, cos=None), _row("pointwise", speed=1.0, loss=None, cos=None)]
    policy = Chosen(rows, "gemm+keep", census_every_n_steps=1)
    trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    assert policy.choice.chosen == "gemm+keep"
    assert policy.table["activation"] == "keep"
    # softmax fp32 -> `s * 10` and gelu keep fp32; the GEMMs in bf16; norm, softmax and loss in fp32
    assert model.seen == dict(linear=BF, norm=FP, softmax=FP, gelu=FP, matmul=BF, inner=BF, head=BF, loss=FP)
    assert "table 'gemm+keep'" in policy.decisions["matmul"].reason
    assert "per class: 2.50x faster" in (
        policy.decisions["matmul"].reason)
    _, texts = read_events(str(tmp_path))
    decision = texts["opkit/precision/decision"][0][1]
    assert "chosen table 'gemm+keep': 90.0 ms, loss change 1.00e-05" in decision
    assert "plain bf16-mixed on the same rows: 91.0 ms, loss change 2.00e-05, grad cosine 0.999800" in decision
    assert "| gemm+keep |" in texts["opkit/precision/sensitivity"][0][1]
    census = texts["opkit/precision/census"][-1][1]
    assert "| activation | fp32 | class rule (keep) |" in census  # keep: ran in the dtype its input had
    assert any("plain bf16-mixed" in line for line in policy.summary_lines())


def test_auto_without_bf16_units_keeps_fp32_and_stands_aside(tmp_path):
    # What an AVX2-only CPU measures: bf16 GEMMs 12x slower; no lowered table is even run, fp32 wins.
    model = Probe()
    rows = [_row("matmul", speed=12.0, fp32_ms=2.0), _row("norm", speed=1.5, fp32_ms=0.2),
            _row("activation", speed=1.4, fp32_ms=0.2), _row("softmax", speed=1.3, fp32_ms=0.2)]
    policy = Injected(rows, census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    assert policy.choice.chosen == "fp32"
    assert policy._governor.passthrough
    assert [r.name for r in policy.choice.runs if r.ms is not None] == ["fp32"]
    assert model.seen["linear"] == FP
    assert model.seen["matmul"] == FP


class HookedProbe(Probe):
    """Counts the forwards of ``body`` and records whether each step ran as a replay."""

    def __init__(self):
        super().__init__()
        self.forwards: list[torch.dtype] = []
        self.replays: list[bool] = []
        self.body.register_forward_hook(lambda m, a, out: self.forwards.append(out.dtype))

    def training_step(self, batch, batch_idx):
        self.replays.append(replaying())
        return super().training_step(batch, batch_idx)


def test_the_speed_check_of_explicit_rules_runs_no_extra_forward(tmp_path):
    model = HookedProbe()
    policy = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=0)  # measure=True
    trainer(tmp_path, [policy], max_steps=3).fit(model, make_loader())
    assert model.forwards == [BF, BF, BF]
    assert model.replays == [False, False, False]
    matmul = policy.measurements.get("matmul", "bf16")
    assert matmul.time_ratio > 0
    assert matmul.calls == 4
    _, texts = read_events(str(tmp_path))
    assert "| matmul | bf16 |" in texts["opkit/precision/sensitivity"][0][1]


def test_replaying_tells_user_code_which_runs_are_measurements(tmp_path):
    model = HookedProbe()
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=2).fit(model, make_loader())
    real = [r for r in model.replays if not r]
    assert len(real) == 2
    assert model.replays[-1] is False
    assert sum(model.replays) >= 3
    assert not replaying()


class AutocastOffRegion(Probe):
    """A GEMM the user runs with autocast turned off: they want it at full precision."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        with torch.autocast("cpu", enabled=False):
            h = x @ self.body.weight.T
            self.seen.setdefault("off_region", []).append((h.dtype, F.softmax(h, -1).dtype))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("census", [0, 1])
def test_a_region_where_the_user_turned_autocast_off_runs_as_written(tmp_path, census):
    model = AutocastOffRegion()
    policy = PrecisionPolicy(census_every_n_steps=census, measure=False)
    trainer(tmp_path, [policy], max_steps=3, precision="bf16-mixed").fit(model, make_loader())
    assert model.seen["off_region"] == [(FP, FP)] * 3  # every step, census steps included
    assert model.seen["matmul"] == BF
    assert model.seen["norm"] == FP


def test_a_trial_is_described_by_each_contenders_best_step():
    trial = Trial(["a", "b"], rounds=1)
    trial.add("a", 0.0100), trial.add("b", 0.0099)
    assert trial.winner(TIE) == "a"  # within 2%: the sub-batch choice stays
    assert describe_trial(trial) == "a 10.0 ms, b 9.9 ms (best of 1 training steps each)"


class Trialled(Probe):
    """Records the dtype the GEMMs and GELU ran in at each training step."""

    def __init__(self):
        super().__init__()
        self.per_step = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.per_step.append((self.seen["matmul"], self.seen["gelu"]))
        return loss


def test_close_contenders_are_confirmed_on_real_training_steps(tmp_path):
    model = Trialled()
    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("activation", speed=0.5, loss=None, cos=None),
            _row("norm", speed=1.3, loss=None, cos=None), _row("pointwise", speed=1.2, loss=None, cos=None)]
    # per-class (matmul, activation bf16) 90 ms and its +keep twin and gemm+keep 95 ms: all within 25%, so they
    # contend; fp32 (300 ms) does not
    policy = Chosen(rows, "per-class", others_ms=95.0, autocast_ms=150.0, census_every_n_steps=0, trial_steps=2)
    trainer(tmp_path, [policy], max_steps=8).fit(model, make_loader())
    trial = policy.choice.trial
    names = ["per-class", "gemm+keep", "per-class+keep"]
    assert all(f"{n} " in trial for n in names)
    assert "best of 2 training steps each" in trial
    # step 0 (the measurement) trains on the per-class table; steps 1-6 on each contender, round robin
    gelu = {"per-class": BF, "gemm+keep": FP, "per-class+keep": BF}
    order = ["per-class", "gemm+keep", "per-class+keep", "per-class+keep", "gemm+keep", "per-class"]
    assert model.per_step[1:7] == [(BF, gelu[n]) for n in order]
    winner = policy.choice.chosen
    best = policy.choice.trial_ms  # as recorded: the text rounds to 0.1 ms, too coarse for the 2% tie rule
    assert set(best) == set(names)
    assert best[winner] <= (1 + TIE) * min(best.values())
    assert model.per_step[7] == (BF, gelu[winner])
    assert policy.table["activation"] == policy.choice.best.table[
        "activation"]
    _, texts = read_events(str(tmp_path))
    assert "confirmed on training steps" in texts["opkit/precision/decision"][-1][1]


def test_no_trials_under_torch_compile(tmp_path):
    from lightning_opkit import TorchCompile

    model = Probe()
    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("activation", speed=0.5, loss=None, cos=None)]
    policy = Chosen(rows, "gemm+keep", others_ms=95.0, census_every_n_steps=0)
    trainer(tmp_path, [policy, TorchCompile(backend="eager")], max_steps=3).fit(model, make_loader())
    assert policy.choice.chosen == "gemm+keep"
    assert "TorchCompile attached" in policy.choice.trial


def test_plain_autocast_is_a_candidate_and_runs_as_bf16_mixed_when_chosen(tmp_path):
    # Where the mode's host cost makes every table slower than autocast (a host-bound GPU step), autocast wins, and
    # the step runs exactly as under precision="bf16-mixed": the policy is never slower than that alternative.
    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("norm", speed=1.3, loss=None, cos=None)]
    policy = Chosen(rows, "gemm+keep", others_ms=95.0, autocast_ms=80.0, census_every_n_steps=2, trial_steps=0)
    chosen = Probe()
    trainer(tmp_path / "auto", [policy], max_steps=3).fit(chosen, make_loader())
    plain = Probe()
    trainer(tmp_path / "plain", [], max_steps=3, precision="bf16-mixed").fit(plain, make_loader())
    assert policy.choice.chosen == AUTOCAST
    assert policy._governor.passthrough
    assert chosen.seen == plain.seen
    assert chosen.seen["norm"] == BF
    assert {d.dtype for d in policy.decisions.values()} == {"keep"}
    assert "plain torch.autocast in bf16" in policy.summary_lines()[0]
    assert ("matmul", "bf16") in policy.census  # census steps count what autocast ran
    assert not torch.is_autocast_enabled("cpu")


def test_a_fit_that_ends_during_the_trials_keeps_the_choice_on_the_measured_rows(tmp_path):
    model = Trialled()
    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("activation", speed=0.5, loss=None, cos=None),
            _row("norm", speed=1.3, loss=None, cos=None), _row("pointwise", speed=1.2, loss=None, cos=None)]
    policy = Chosen(rows, "gemm+keep", others_ms=95.0, autocast_ms=150.0, census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=3).fit(model, make_loader())  # 2 of the 6 trial steps
    assert policy.choice.chosen == "gemm+keep"
    assert "not finished" in policy.choice.trial
    assert "after 2 of 6 trial steps" in policy.choice.trial
    assert policy.table["activation"] == "keep"
    assert policy.decisions["activation"].dtype == "keep"


def test_no_candidate_leaves_a_gemm_to_keep_so_none_fails_on_mixed_inputs():
    # With attention lowered and matmul fp32, a matmul left to ``keep`` met a bf16 activation and an fp32 weight
    # ("mat1 and mat2 must have the same dtype") in GPT-2's attention output projection.
    from zoo import build

    model = build("hf_gpt2")
    classes = ["matmul", "attention", "norm", "activation", "loss", "reduction", "pointwise", "embedding"]
    tables = candidate_tables({"attention": "bf16"}, classes)
    assert all(t[c] != "keep" for t in tables.values() for c in ("matmul", "attention"))
    runner = StepRunner(model, next(iter(model.loader())), lambda m, b: m.training_step(b, 0))
    with runner.session():
        choice = choose_table(runner, tables, [], 0.01, 1)
    assert [(r.name, r.failed) for r in choice.runs if r.failed] == []
    assert all(r.ms is not None for r in choice.runs)


def test_a_re_measurement_during_the_trials_ends_the_trial_step_in_progress():
    # remeasure_every_n_steps can re-measure while the last measurement's contenders are still on trial: the step begun
    # for one of them must not be booked to the new trials, whose contenders may be others (a KeyError before).
    from lightning_opkit.precision.auto import AutoPrecision
    from lightning_opkit.precision.results import PrecisionMeasurements

    auto = AutoPrecision(tolerance=0.01, whole_step=True, trial_steps=2)
    names = iter([("a", "b"), ("c", "d")])

    def choose(model, batch, loss_fn, rows, per_class, dtypes, agree, compiled):
        first, second = next(names)
        runs = [TableRun("fp32", {"matmul": "fp32"}, ms=300.0, loss_change=0.0, grad_cosine=1.0),
                TableRun(first, {"matmul": "bf16"}, ms=100.0, loss_change=1e-5, grad_cosine=0.9999),
                TableRun(second, {"matmul": "bf16"}, ms=101.0, loss_change=1e-5, grad_cosine=0.9999)]
        return StepChoice(runs, first, rows=1, seconds=0.0, tolerance=0.01)

    auto._measure = lambda model, batch, loss_fn, **kwargs: PrecisionMeasurements(
        [_row("matmul", speed=0.4, loss=None, cos=None)], device="given", loss=1.0, seconds=0.0)
    auto._choose = choose
    cpu, same = torch.device("cpu"), lambda value: value
    decide = lambda: auto.measure_and_decide(None, torch.zeros(8, 2), None, 0, ["bf16"], same, False, False)  # noqa: E731
    decide()
    assert auto.trialing
    assert auto.begin_trial_step(cpu, census_step=False).classes["matmul"].dtype == "bf16"  # "a" begins
    decide()  # contenders "c" and "d" now
    assert auto.end_trial_step(cpu, same) is None
    for _ in range(4):  # c d d c: the new trials run to the end and pick one of theirs
        auto.begin_trial_step(cpu, census_step=False)
        plan = auto.end_trial_step(cpu, same)
    assert plan is not None
    assert auto.choice.chosen in ("c", "d")
    assert not auto.trialing
