"""When the policy measures, Trainer-free: first batch, every N steps, once per optimizer step, a checkpoint's plan."""

from lightning_opkit.precision.schedule import MeasureSchedule


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
