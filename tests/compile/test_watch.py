"""Dynamo's counters as TorchCompile reads them (compile/watch.py), without a Trainer: graphs, graph breaks with their
reason, recompiles with the guard that failed, each as a delta from when the watch opened; nothing left registered."""

import logging
from collections import Counter

import torch

from lightning_opkit.compile.watch import DynamoWatch, expected_recompile, recompile_table


def _breaks(x):
    y = x.sin()
    print("", end="")  # a graph break
    return y.cos()


def test_graphs_breaks_and_recompiles_are_counted_from_when_the_watch_opened():
    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # before: not counted
    watch = DynamoWatch()
    watch.open()
    try:
        compiled = torch.compile(_breaks, backend="eager", dynamic=False)
        compiled(torch.ones(2))
        compiled(torch.ones(3))  # a new size, dynamic=False: a recompile
    finally:
        watch.close()
    assert watch.graphs >= 2
    assert watch.graph_break_total >= 1
    assert any("print" in reason for reason in watch.graph_breaks())
    assert watch.compiles >= 2
    assert watch.recompile_reasons
    rows = recompile_table(watch.recompile_reasons)
    assert any("_breaks" in where and "size" in guard for where, guard, _ in rows), rows
    assert not logging.getLogger("torch._dynamo.guards.recompiles").handlers  # closed: nothing left behind
    watch.close()  # twice is harmless


def test_a_watch_that_never_opened_reports_nothing_of_the_process_before_it():
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    watch = DynamoWatch()
    assert (watch.graphs, watch.graph_break_total, watch.frames) == (0, 0, 0)


def test_a_size_change_is_expected_twice_then_worth_a_warning_and_never_with_dynamic_false():
    reason = "Recompiling function forward in m.py:3 ... failure(s):\n - 0/0: tensor 'x' size mismatch at index 0"
    seen = Counter()
    assert [expected_recompile(reason, seen) for _ in range(3)] == [True, True, False]
    assert not expected_recompile(reason, Counter(), sizes_dynamic=False)
