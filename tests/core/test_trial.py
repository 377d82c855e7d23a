"""The one timed trial: its schedule, real timing on the host clock, and the figures read from recorded times."""

from __future__ import annotations

import torch

from lightning_opkit.core.trial import WARMUP, Trial


def test_the_schedule_warms_up_then_mirrors_each_round_and_ends():
    trial = Trial(["a", "b", "c"], rounds=2, warmup=2)
    assert trial.order == ["a", "b", "c", "c", "b", "a"]
    handed = [trial.next() for _ in range(9)]
    assert handed == [WARMUP, WARMUP, "a", "b", "c", "c", "b", "a", None]
    assert trial.calls == 8  # a None is not a call
    assert trial.done


def test_a_call_in_flight_is_not_done_and_a_dropped_call_is_no_sample():
    trial = Trial(["a"], rounds=1)
    arm = trial.next()
    assert arm == "a"
    trial.start(arm, "cpu")
    assert not trial.done  # handed out, still running
    torch.ones(256, 256) @ torch.ones(256, 256)
    trial.stop(keep=False)
    assert trial.done
    assert trial.seconds("a") == []
    assert trial.best() == {}
    again = Trial(["a"], rounds=1)
    again.start(again.next() or "", "cpu")
    torch.ones(256, 256) @ torch.ones(256, 256)
    again.stop()
    assert len(again.seconds("a")) == 1
    assert again.seconds("a")[0] > 0


def test_figures_come_from_the_recorded_times():
    trial = Trial(["a", "b", "c"], rounds=2)
    for name, s in zip(trial.order, [10.0, 9.0, 12.0, 12.5, 9.2, 10.1]):
        trial.add(name, s)
    assert trial.best() == {"a": 10.0, "b": 9.0, "c": 12.0}
    assert trial.median("c") == 12.25
    assert trial.winner(tie=0.02) == "b"
    assert trial.ratio("c", "b") == 12.25 / 9.1
    cold = Trial(["a", "b"], rounds=2)  # b's first call paid a one-off cost: its best call counts
    for name, s in zip(cold.order, [10.0, 25.0, 9.5, 10.2]):
        cold.add(name, s)
    assert cold.winner(tie=0.02) == "b"
    tie = Trial(["a", "b"], rounds=1)
    tie.add("a", 10.0), tie.add("b", 9.9)
    assert tie.winner(tie=0.02) == "a"  # within 2%: the earlier arm stays
    assert tie.winner(tie=0.0) == "b"
    assert Trial(["x", "y"], rounds=1).ratio("x", "y") == 1.0  # nothing measured: nothing to decide on
