"""Steps leave no garbage in reference cycles: memory is freed when a step's objects go, not at a full collection."""

import collections
import gc

import lightning.pytorch as pl
from helpers import TinyNet, make_loader, trainer
from zoo import build

from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile


def _ours(obj) -> bool:
    """Whether ``obj`` is an opkit function, or an instance of a class opkit defines."""
    module = getattr(obj, "__module__", None) if callable(obj) and hasattr(obj, "__code__") else type(obj).__module__
    return isinstance(module, str) and module.startswith("lightning_opkit")


class _Garbage(pl.Callback):
    """Counts what the collector finds in reference cycles between two steps (``DEBUG_SAVEALL`` keeps it to look at)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.found: collections.Counter[str] | None = None
        self.ours: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.start:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
        elif trainer.global_step == self.end:
            gc.collect()
            self.found = collections.Counter(type(x).__name__ for x in gc.garbage)
            self.ours = [x for x in gc.garbage if _ours(x)]
            gc.set_debug(0)
            gc.garbage.clear()


def _callbacks(compile: bool = True):
    return [PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=3), NaNDetector(action="skip"),
            ProfilerWindows(every_n_steps=20, warmup=1, active=2, roofline=True),
            *([TorchCompile(modules="auto", backend="eager")] if compile else [])]


def test_healthy_steps_leave_no_garbage_in_cycles(tmp_path):
    # census steps, checked steps: nothing left for the collector
    garbage = _Garbage(start=4, end=16)
    model = build("torch_encoder")
    trainer(tmp_path, [*_callbacks(compile=False), garbage], max_steps=17).fit(model, model.loader(n=160))
    assert garbage.found is not None
    assert sum(garbage.found.values()) == 0, garbage.found.most_common(10)


def test_compiled_steps_leave_no_garbage_of_ours(tmp_path):
    # compiled regions too; dynamo's own compile-time structures (freed whenever its caches let go, in whichever test
    # that falls) are dynamo's, so the check is that nothing of opkit's is left in a cycle
    garbage = _Garbage(start=4, end=16)
    model = build("torch_encoder")
    trainer(tmp_path, [*_callbacks(), garbage], max_steps=17).fit(model, model.loader(n=160))
    assert garbage.found is not None
    assert garbage.ours == []
    assert garbage.found["FunctionEvent"] == 0


def test_a_skipped_step_leaves_no_garbage_in_cycles(tmp_path):
    # the slow path: localization and cause replays, the skip, the report
    garbage = _Garbage(start=4, end=16)
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=3), detector, garbage],
            max_steps=17).fit(TinyNet(forward_steps=(9,)), make_loader(n=256))
    assert [e["step"] for e in detector.events] == [9]
    assert garbage.found is not None
    assert garbage.ours == []
    # torch's own pytree flattening leaves a closure that refers to itself (tree_flatten's ``helper``) per call; the
    # replays make a few such calls, nothing more
    assert sum(garbage.found.values()) < 50, garbage.found.most_common(10)


def test_a_profiler_window_frees_its_events(tmp_path):
    # the window (steps 20-23, roofline on) parses thousands of profiler events into a tree of parents and children;
    # release unlinks it, so none waits for a full collection. The roofline picture is a matplotlib figure, a web of
    # references by design: one per window, bounded.
    garbage = _Garbage(start=16, end=26)
    model = build("torch_encoder")
    trainer(tmp_path, [*_callbacks(), garbage], max_steps=27).fit(model, model.loader(n=160))
    assert garbage.found is not None
    assert garbage.found["FunctionEvent"] == 0
    assert garbage.found["Interval"] == 0
    assert garbage.found["frame"] == 0  # no exception kept alive with its traceback
    assert garbage.ours == []
    assert sum(garbage.found.values()) < 6000, garbage.found.most_common(10)
