"""``logger=False``: opkit writes no file unless the user gives ``log_dir`` (core/logging.py, core/summary.py)."""

import os

import lightning.pytorch as pl
from helpers import read_events
from zoo import build

from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile


def _kit(**kw):
    return [PrecisionPolicy(census_every_n_steps=2, **kw), NaNDetector(action="skip", **kw),
            ProfilerWindows(every_n_steps=2, warmup=0, active=1, roofline=True, memory=True, **kw),
            TorchCompile(modules="auto", backend="eager", **kw), ActivationCheckpointing(**kw)]


def _fit(root, callbacks, **kwargs):
    model = build("hf_gpt2")
    pl.Trainer(default_root_dir=str(root), max_steps=5, accelerator="cpu", enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, **kwargs).fit(
        model, model.loader())


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_with_logger_false_the_whole_kit_writes_no_file_and_the_summary_says_where_logs_would_go(tmp_path, capsys):
    callbacks = _kit()
    _fit(tmp_path / "root", callbacks, logger=False)
    assert _files(tmp_path) == []
    windows = callbacks[2]
    assert windows.windows_done == 2  # it profiled, kept its reports ...
    assert windows.last_roofline is not None
    assert windows.trace_files == []  # ... and wrote nothing
    out = capsys.readouterr().out
    assert "logs: none (the Trainer has no logger; log_dir= writes opkit's TensorBoard files)" in out
    assert "tensorboard --logdir" not in out
    assert "no trace files (the Trainer has no logger; log_dir= keeps them)" in out


def test_with_logger_false_and_a_log_dir_the_kit_writes_there(tmp_path, capsys):
    asked = str(tmp_path / "asked")
    callbacks = _kit(log_dir=asked)
    _fit(tmp_path / "root", callbacks, logger=False)
    assert not os.path.exists(tmp_path / "root")
    scalars, texts = read_events(asked)
    assert {"opkit/nan/events", "opkit/profiler/step_time_ms", "opkit/compile/compiles"} <= set(scalars)
    assert "opkit/summary" in texts
    assert [os.path.dirname(p) for p in callbacks[2].trace_files] == [os.path.join(asked, "traces")] * 2
    assert f"tensorboard --logdir {asked}" in capsys.readouterr().out


def test_with_a_csv_logger_alone_only_its_files_are_written(tmp_path, capsys):
    csv = pl.loggers.CSVLogger(str(tmp_path / "csv"))
    _fit(tmp_path / "root", _kit(), logger=csv)
    files = _files(tmp_path)
    assert not [f for f in files if "tfevents" in f]  # no TensorBoard files of opkit's own
    assert any(f.endswith("metrics.csv") for f in files)
    assert any(f.endswith("opkit/summary.md") for f in files)
    out = capsys.readouterr().out
    assert "tensorboard --logdir" not in out
    assert "(no TensorBoard logger: log_dir= adds opkit's event files)" in out
