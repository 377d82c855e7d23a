"""Timing on the device's clock (core/timing.py): against an independent clock, a known sleep is what it reports."""

import time

import torch

from lightning_opkit.core.timing import StepClock, at_shapes, best_seconds, filled_seconds, per_call_seconds, sync


def _sleeper(seconds: float, calls: list[int]):
    def fn():
        calls.append(1)
        time.sleep(seconds)

    return fn


def test_per_call_seconds_divides_by_the_calls_made():
    calls: list[int] = []
    began = time.perf_counter()
    per_call = per_call_seconds(_sleeper(0.002, calls), "cpu", calls=5)
    wall = time.perf_counter() - began
    assert len(calls) == 5
    assert per_call >= 0.002  # sleep sleeps at least as long as asked
    assert per_call * 5 <= wall  # and no longer than an outside clock saw


def test_best_seconds_warms_up_once_and_keeps_the_fastest_sample():
    calls: list[int] = []
    best = best_seconds(_sleeper(0.001, calls), "cpu", reps=3, calls=2)
    assert len(calls) == 1 + 3 * 2
    assert best >= 0.001


def test_filled_seconds_makes_as_many_calls_as_fill_the_time_asked_at_most_20():
    calls: list[int] = []
    filled_seconds(_sleeper(0.001, calls), "cpu", fill_s=0.003)
    # one call timed (after a warm-up call), then a warm-up and 3 samples of as many calls as fill fill_s: a call
    # sleeps 1 ms or more, so at most 3 a sample (fewer on a busy machine)
    per_sample, left = divmod(len(calls) - 3, 3)
    assert left == 0
    assert 1 <= per_sample <= 3
    calls.clear()
    filled_seconds(lambda: calls.append(1), "cpu", fill_s=10.0)
    assert len(calls) == 3 + 3 * 20


def test_step_clock_keeps_only_the_steps_asked_and_on_the_host_clock():
    clock = StepClock()
    for keep in (True, False, True):
        clock.start("cpu")
        time.sleep(0.001)
        clock.stop(keep=keep)
    clock.stop(keep=True)  # stopped twice: nothing started, nothing kept
    times = clock.seconds()
    assert len(times) == 2
    assert all(t >= 0.001 for t in times)


def test_sync_on_a_cpu_is_a_no_op():
    sync("cpu")
    sync(None)
    sync(torch.device("cpu"))


def test_at_shapes_samples_in_turn_gives_up_on_a_clearly_slower_variant_and_times_a_shape_once():
    order: list[str] = []

    def fast():
        order.append("a")

    def slow():
        order.append("b")
        time.sleep(0.05)  # 50 ms: clearly slower than an empty call even on a busy machine

    key = ("a test op", id(order))
    times = at_shapes(key, {"a": fast, "b": slow}, "cpu", reps=3, fill_s=1e-3, give_up=2.0)
    # a warm-up call each, one timed call each (the slowest, 50 ms, sets one call per sample), then the rounds in
    # turn: b, clearly slower after its first sample, is not sampled again
    assert order == ["a", "b", "a", "b", "a", "b", "a", "a"]
    assert times["b"] >= 0.05
    assert at_shapes(key, {"a": fast, "b": slow}, "cpu") is times  # the same shapes again: not timed again
    assert len(order) == 8


def test_count_weighted_ratio_weighs_by_calls_skips_untimed_shapes_and_times_lazily():
    from lightning_opkit.core.timing import count_weighted_ratio

    reached = []

    def timed(word, pair):
        reached.append(word)
        return pair

    rows = ((n, timed(w, p), w) for n, p, w in [(3, (1.0, 2.0), "a"), (1, None, "b"), (1, (4.0, float("nan")), "c"),
                                                  (1, (1.0, 1.0), "d")])
    first = next(rows)
    assert reached == ["a"]  # a shape is timed when reached, not before
    assert count_weighted_ratio([first, *rows]) == ((3 * 2.0 + 1.0) / (3 * 1.0 + 1.0), ["a", "d"])
    assert count_weighted_ratio([(1, None, "x")]) is None
    assert count_weighted_ratio([(1, (0.0, 1.0), "zero")]) is None  # no baseline time: no ratio
