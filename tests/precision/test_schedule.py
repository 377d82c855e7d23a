"""When the policy measures, Trainer-free: first batch, every N steps, once per optimizer step, a checkpoint's plan;
around each batch, which steps a trial samples, take a census or are speed-checked."""

import torch

from lightning_opkit.precision.auto import AutoPrecision
from lightning_opkit.precision.candidates import StepChoice, TableRun
from lightning_opkit.precision.governor import StepGovernor
from lightning_opkit.precision.results import PrecisionMeasurements
from lightning_opkit.precision.schedule import MeasureSchedule, PolicySteps
from precision.test_auto import _row


def test_auto_measures_at_the_first_batch_then_every_n_steps_once_per_optimizer_step():
    schedule = MeasureSchedule(auto=True, measure=True, every=3)
    # steps as batches see them: gradient accumulation repeats a step
    seen = [(step, schedule.at(step)) for step in (0, 0, 1, 1, 2, 3, 3, 4, 6)]
    assert seen == [(0, "measure"), (0, None), (1, None), (1, None), (2, None), (3, "measure"), (3, None), (4, None),
                    (6, "measure")]
    assert MeasureSchedule(auto=True, measure=True, every=0).at(5) == "measure"  # the first batch of any fit


def test_a_checkpoint_plan_runs_at_the_first_batch_instead_of_a_measurement_and_only_once():
    schedule = MeasureSchedule(auto=True, measure=True, every=0)
    schedule.restored = "the checkpoint's plan"
    assert schedule.at(10) == "restore"
    assert schedule.take_restored() == "the checkpoint's plan"
    assert schedule.take_restored() is None
    assert schedule.at(11) is None
    schedule.start()  # a new fit measures afresh
    assert schedule.at(0) == "measure"


def test_explicit_rules_are_speed_checked_once_and_not_at_all_without_measure():
    checked = MeasureSchedule(auto=False, measure=True, every=0)
    assert [checked.at(s) for s in (0, 1, 2)] == ["speed check", None, None]
    assert [MeasureSchedule(auto=False, measure=False, every=0).at(s) for s in (0, 1)] == [None, None]
    assert MeasureSchedule(auto=False, measure=True, every=2).at(0) == "speed check"


# Around each batch (PolicySteps), without a Trainer


def _trialing() -> PolicySteps:
    """Steps whose auto part measured once and put two contenders on trial, two steps each (A B B A)."""
    auto = AutoPrecision(tolerance=0.01, whole_step=True, trial_steps=2)

    def choose(model, batch, loss_fn, rows, per_class, dtypes, agree, compiled):
        runs = [TableRun("fp32", {"matmul": "fp32"}, ms=300.0, loss_change=0.0, grad_cosine=1.0),
                TableRun("a", {"matmul": "bf16"}, ms=100.0, loss_change=1e-5, grad_cosine=0.9999),
                TableRun("b", {"matmul": "bf16"}, ms=101.0, loss_change=1e-5, grad_cosine=0.9999)]
        return StepChoice(runs, "a", rows=1, seconds=0.0, tolerance=0.01)

    auto._measure = lambda model, batch, loss_fn, **kwargs: PrecisionMeasurements(
        [_row("matmul", speed=0.4, loss=None, cos=None)], device="given", loss=1.0, seconds=0.0)
    auto._choose = choose
    steps = PolicySteps(auto, MeasureSchedule(auto=True, measure=True, every=0), StepGovernor({}))
    assert steps.start(0, CPU, False, bool, list).measure
    auto.measure_and_decide(None, torch.zeros(8, 2), None, 0, ["bf16"], lambda v: v, False, False)
    assert auto.trialing
    steps.end(CPU, lambda v: v, {})
    return steps


CPU = torch.device("cpu")


def _never():
    raise AssertionError("asked on a batch that needs no answer: work on every batch's hot path")


def test_a_trial_takes_no_sample_on_a_census_step_nor_while_another_callback_times_its_own():
    steps = _trialing()
    sampled, winner = [], None
    for step in range(1, 12):
        # a census every 3 steps; at step 2 another callback times its own alternatives
        start = steps.start(step, CPU, step % 3 == 0, lambda step=step: step == 2, list)
        assert steps.governor.census_step == (step % 3 == 0)
        if start.trial is not None:
            sampled.append(step)
        end = steps.end(CPU, lambda v: v, {})
        if end.plan is not None:
            winner = (step, end.plan)
            break
    assert sampled == [1, 4, 5, 7]  # not 2 (timed by another), 3 and 6 (census steps)
    assert winner is not None
    assert winner[0] == 7  # the fourth sample ends the trial
    assert not steps.auto.trialing


def test_a_checkpoint_s_plan_runs_instead_of_a_measurement_and_explicit_rules_record_one_step():
    auto = PolicySteps(AutoPrecision(0.01, True, 2), MeasureSchedule(auto=True, measure=True, every=0),
                       StepGovernor({}))
    auto.schedule.restored = "the checkpoint's plan"
    start = auto.start(5, CPU, False, _never, _never)  # neither is asked off a trial step and the speed check's batch
    assert (start.restore, start.measure, start.trial) == ("the checkpoint's plan", False, None)
    explicit = PolicySteps(AutoPrecision(0.01, True, 2), MeasureSchedule(auto=False, measure=True, every=0),
                           StepGovernor({}))
    explicit.start(0, CPU, False, bool, list)
    assert explicit.governor.speed_log is None  # nothing lowered: nothing to check
    explicit.schedule.start()
    explicit.start(0, CPU, False, bool, lambda: ["matmul"])
    assert explicit.governor.speed_log is not None  # this batch's step is recorded
    assert explicit.end(CPU, lambda v: v, {}).speed is None  # the step never ran: nothing timed


def test_an_ordinary_batch_asks_nothing_and_is_handed_nothing_and_a_remeasurement_mid_trial_still_samples():
    auto = PolicySteps(AutoPrecision(0.01, True, 2), MeasureSchedule(auto=True, measure=True, every=5),
                       StepGovernor({}))
    assert auto.start(0, CPU, False, _never, _never).measure
    auto.end(CPU, _never, {})
    for step in (1, 2, 3, 4, 6):  # decided, not trialing, no census: the fast path on both sides
        start, end = auto.start(step, CPU, False, _never, _never), auto.end(CPU, _never, {})
        assert (start.trial, start.restore, start.measure) == (None, None, False)
        assert (end.plan, end.speed, end.census) == (None, None, None)
    assert auto.start(5 * 2, CPU, False, _never, _never).measure  # every=5: step 10 measures again
    steps = _trialing()
    steps.schedule.every = 2
    start = steps.start(2, CPU, False, bool, _never)  # a trial step that is also a remeasurement: both, as before
    assert start.measure
    assert start.trial is not None
