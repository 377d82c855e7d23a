"""Every Lightning strategy works or is refused at setup (core/strategies.py).

Works, tested: single device (everywhere), ``ddp`` (tests/test_ddp.py), ModelParallelStrategy (FSDP2 and tensor
parallel: tests/test_sharded.py) and ``ddp_spawn`` (here: each process gets the callbacks pickled). Refused before
anything attaches: DeepSpeed and FSDP1 (``FSDPStrategy``), which cannot be constructed on this CPU machine (DeepSpeed is
not installed; FSDP1 needs CUDA), so their refusal is tested on their real classes, and the refusal's path through
each callback's setup with a real Trainer whose strategy the test adds to the refused ones.
"""

import os
import pickle
import subprocess
import sys

import lightning.pytorch as pl
import pytest
from helpers import ROOT, TinyNet, make_loader, read_events, snapshot
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.core import strategies
from lightning_opkit.core.strategies import strategy_refusal


def _five():
    return [PrecisionPolicy(census_every_n_steps=2, measure=False), NaNDetector(action="skip"),
            ProfilerWindows(every_n_steps=3, warmup=0, active=1, export_trace=False), TorchCompile(backend="eager"),
            ActivationCheckpointing(modules=["body"], measure=False)]


@pytest.mark.parametrize("strategy", [DeepSpeedStrategy, FSDPStrategy])
def test_deepspeed_and_fsdp1_are_refused_by_their_real_classes(strategy):
    assert strategy_refusal(strategy)
    assert strategy_refusal(type("Mine", (strategy,), {}))  # a user's subclass too


@pytest.mark.parametrize("strategy", [DDPStrategy, SingleDeviceStrategy])
def test_the_strategies_that_work_are_not_refused(strategy):
    assert strategy_refusal(strategy) is None


@pytest.mark.parametrize("index", range(5))
def test_each_callback_refuses_at_setup_naming_the_strategy_and_what_works_and_attaches_nothing(tmp_path, monkeypatch,
                                                                                                 index):
    monkeypatch.setitem(strategies.REFUSED, "SingleDeviceStrategy", "the test refuses it")
    callback = _five()[index]
    model = TinyNet()
    before = snapshot(model)
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[callback])
    with pytest.raises(ValueError, match=rf"{type(callback).__name__} does not run under Lightning's "
                                         r"SingleDeviceStrategy: the test refuses it; use strategy='ddp', or for a "
                                         r"sharded model ModelParallelStrategy"):
        trainer.fit(model, make_loader())
    assert snapshot(model) == before
    assert trainer.global_step == 0


def test_every_callback_pickles_as_ddp_spawn_sends_it():
    for callback in _five() + [PrecisionPolicy(rules="auto")]:
        again = pickle.loads(pickle.dumps(callback))
        assert type(again) is type(callback)


_SPAWN = """
import sys
sys.path[:0] = ["tests", "."]
import lightning.pytorch as pl
from helpers import TinyNet, make_loader
from core.test_strategies import _five

if __name__ == "__main__":
    root = sys.argv[1]
    pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_steps=6, default_root_dir=root,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
               logger=pl.loggers.TensorBoardLogger(root), callbacks=_five()).fit(TinyNet(forward_steps=(2,)),
                                                                               make_loader())
"""


@pytest.mark.slow
def test_all_five_under_ddp_spawn_find_the_fault_and_write_their_logs(tmp_path):
    """Each spawned process gets the callbacks pickled; rank zero's logs hold the fault, skipped at its step."""
    script = tmp_path / "spawn.py"
    script.write_text(_SPAWN)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars, texts = read_events(str(tmp_path / "run"))
    assert scalars["opkit/nan/events"][0] == (2, 1.0)
    assert "opkit/profiler/step_time_ms" in scalars
    summary = texts["opkit/summary"][-1][1]
    assert "first at step 2: forward in 'body.1'" in summary
    assert "activation checkpointing (full): 1 block(s)" in summary
