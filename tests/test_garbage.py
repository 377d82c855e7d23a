"""Steps leave no garbage in reference cycles: memory is freed when a step's objects go, not at a full collection.

Each scenario runs in a fresh interpreter: what earlier tests compiled or profiled is freed whenever torch's caches
let go, which would land in whichever test is counting.
"""

import collections
import gc
import json
import os
import subprocess
import sys

import lightning.pytorch as pl

HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(obj) -> bool:
    """Whether ``obj`` is an opkit function, or an instance of a class opkit defines."""
    module = getattr(obj, "__module__", None) if callable(obj) and hasattr(obj, "__code__") else type(obj).__module__
    return isinstance(module, str) and module.startswith("lightning_opkit")


class _Garbage(pl.Callback):
    """Counts what the collector finds in reference cycles between two steps (``DEBUG_SAVEALL`` keeps it to look at)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.found: collections.Counter[str] = collections.Counter()
        self.ours: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.start:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
        elif trainer.global_step == self.end:
            gc.collect()
            self.found = collections.Counter(type(x).__name__ for x in gc.garbage)
            self.ours = [repr(x)[:80] for x in gc.garbage if _ours(x)]
            gc.set_debug(0)
            gc.garbage.clear()


def _scenario(name: str, root: str) -> dict:
    from helpers import TinyNet, make_loader, trainer
    from zoo import build

    from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile

    policy = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=3)
    windows = ProfilerWindows(every_n_steps=20, warmup=1, active=2, roofline=True)
    detector = NaNDetector(action="skip")
    if name == "healthy":  # census steps, checked steps
        garbage, model, callbacks, steps = _Garbage(4, 16), build("torch_encoder"), [policy, detector, windows], 17
    elif name == "compiled":  # and compiled regions (dynamo's own compile-time structures are dynamo's)
        garbage, model, steps = _Garbage(6, 16), build("torch_encoder"), 17
        callbacks = [policy, detector, windows, TorchCompile(modules="auto", backend="eager")]
    elif name == "skipped":  # the slow path: localization and cause replays, the skip, the report
        garbage, model, callbacks, steps = _Garbage(4, 16), TinyNet(forward_steps=(9,)), [policy, detector], 17
    else:  # a profiler window (steps 20-23, roofline on)
        garbage, model, callbacks, steps = _Garbage(16, 26), build("torch_encoder"), [policy, detector, windows], 27
    loader = make_loader(n=256) if isinstance(model, TinyNet) else model.loader(n=160)
    trainer(root, [*callbacks, garbage], max_steps=steps).fit(model, loader)
    # The same steps without opkit: what torch and Lightning leave themselves. On a CUDA wheel torch's optimizer asks
    # torch.cuda.is_available() every step (its CUDA-graph capture check), which under Lightning's
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 goes through ctypes and leaves a few ctypes types in cycles; the CPU wheel none.
    plain = _Garbage(garbage.start, garbage.end)
    again = TinyNet(forward_steps=(9,)) if isinstance(model, TinyNet) else build(model.case.name)
    trainer(os.path.join(root, "plain"), [plain], max_steps=steps).fit(again, loader)
    return {"found": dict(garbage.found), "plain": dict(plain.found), "ours": garbage.ours,
            "events": [e["step"] for e in detector.events]}


def _added(result: dict) -> dict:
    """What opkit's run left beyond the plain run's, by type."""
    return dict(collections.Counter(result["found"]) - collections.Counter(result["plain"]))


def _run(name: str, tmp_path) -> dict:
    proc = subprocess.run([sys.executable, __file__, name, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(HERE),
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_healthy_steps_leave_no_garbage_in_cycles(tmp_path):
    result = _run("healthy", tmp_path)
    assert _added(result) == {}, (result["found"], result["plain"])
    assert result["ours"] == []


def test_compiled_steps_leave_no_garbage_of_ours(tmp_path):
    result = _run("compiled", tmp_path)
    assert result["ours"] == []
    assert result["found"].get("FunctionEvent", 0) == 0


def test_a_skipped_step_leaves_no_garbage_of_ours(tmp_path):
    result = _run("skipped", tmp_path)
    assert result["events"] == [9]
    assert result["ours"] == []
    # torch's own pytree flattening leaves a closure that refers to itself (tree_flatten's ``helper``) per call; the
    # replays make a few such calls, nothing more
    assert sum(_added(result).values()) < 50, result["found"]


def test_a_profiler_window_frees_its_events(tmp_path):
    # the window parses thousands of profiler events into a tree of parents and children; release unlinks it, so none
    # waits for a full collection. The roofline picture is a matplotlib figure, a web of references by design: one
    # per window, bounded.
    result = _run("window", tmp_path)
    found = result["found"]
    assert found.get("FunctionEvent", 0) == 0
    assert found.get("Interval", 0) == 0
    assert found.get("frame", 0) == 0  # no exception kept alive with its traceback
    assert result["ours"] == []
    assert sum(_added(result).values()) < 6000, sorted(found.items(), key=lambda kv: -kv[1])[:10]


if __name__ == "__main__":
    print(json.dumps(_scenario(sys.argv[1], sys.argv[2])))
