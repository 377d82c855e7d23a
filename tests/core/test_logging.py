"""``logger=False``: opkit writes no file unless the user gives ``log_dir`` (core/logging.py, core/summary.py)."""

import ast
import os
import pathlib
import re

import lightning.pytorch as pl
import pytest
from helpers import ROOT, TinyNet, make_loader, read_events
from zoo import build

import lightning_opkit
from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.core.logging import TAGS, LogWriter, UnlistedTagWarning, markdown_table, tags_markdown


def _kit(**kw):
    return [PrecisionPolicy(census_every_n_steps=2, **kw), NaNDetector(action="skip", **kw),
            ProfilerWindows(every_n_steps=2, warmup=0, active=1, roofline=True, memory_breakdown=True, **kw),
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


class _Writes(pl.Callback):
    def __init__(self, log_dir=None):
        self.given = log_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w = LogWriter(trainer, self.given)
        w.scalar("opkit/nan/events", batch_idx * 1.5, trainer.global_step)
        w.table("opkit/profiler/top_ops", ["a", "b"], [[1, 2.5]], trainer.global_step)
        w.close()
        self.log_dir = w.log_dir


def test_writes_to_the_trainers_tensorboard_logger(tmp_path):
    cb = _Writes()
    pl.Trainer(default_root_dir=tmp_path, max_steps=3, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=pl.loggers.TensorBoardLogger(tmp_path)).fit(TinyNet(), make_loader())
    assert cb.log_dir == os.path.join(tmp_path, "lightning_logs", "version_0")
    scalars, texts = read_events(cb.log_dir)
    assert scalars["opkit/nan/events"] == [(1, 0.0), (2, 1.5), (3, 3.0)]
    assert "| 1 | 2.500 |" in texts["opkit/profiler/top_ops"][0][1]


def test_without_a_logger_nothing_is_written_unless_a_log_dir_is_given(tmp_path):
    cb = _Writes()
    pl.Trainer(default_root_dir=tmp_path / "root", max_steps=2, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=False).fit(TinyNet(), make_loader())
    assert not os.path.exists(tmp_path / "root")  # logger=False: no file
    cb = _Writes(str(tmp_path / "asked"))
    pl.Trainer(default_root_dir=tmp_path / "root", max_steps=2, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=False).fit(TinyNet(), make_loader())
    assert cb.log_dir == str(tmp_path / "asked")
    assert read_events(cb.log_dir)[0]["opkit/nan/events"] == [(1, 0.0), (2, 1.5)]


def test_every_logger_of_the_trainer_gets_the_figures(tmp_path):
    """TensorBoard and a CSVLogger side by side: scalars in both, tables and the picture beside metrics.csv."""
    import csv

    from lightning_opkit import NaNDetector, ProfilerWindows

    csv_logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    callbacks = [NaNDetector(action="skip"), ProfilerWindows(every_n_steps=3, warmup=0, active=1, roofline=True,
                                                             export_trace=False)]
    pl.Trainer(default_root_dir=tmp_path, max_steps=5, callbacks=callbacks, enable_progress_bar=False,
               enable_checkpointing=False, enable_model_summary=False,
               logger=[pl.loggers.TensorBoardLogger(tmp_path), csv_logger]).fit(
        TinyNet(forward_steps=(2,)), make_loader())
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    events = [(int(r["step"]), float(r["opkit/nan/events"])) for r in rows if r.get("opkit/nan/events")]
    assert events[0] == (2, 1.0)  # the skipped step's event, at its step
    windows = [float(r["opkit/profiler/step_time_ms"]) for r in rows if r.get("opkit/profiler/step_time_ms")]
    assert len(windows) == 1
    assert windows[0] > 0
    scalars, _ = read_events(str(tmp_path / "lightning_logs"))
    assert scalars["opkit/profiler/step_time_ms"][0][1] == pytest.approx(windows[0])
    assert scalars["opkit/nan/events"][0] == (2, 1.0)
    folder = os.path.join(csv_logger.log_dir, "opkit")
    with open(os.path.join(folder, "nan_report.md")) as f:
        assert "Non-finite output at global step 2" in f.read()
    with open(os.path.join(folder, "profiler_roofline.md")) as f:
        assert "| class | dtype |" in f.read()
    with open(os.path.join(folder, "profiler_roofline_plot.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _event_dirs(root):
    """Every directory holding TensorBoard event files, found on the file system (not from the kit's account)."""
    return sorted({d for d, _, fs in os.walk(root) for f in fs if f.startswith("events.out.tfevents.")})


def test_a_log_dir_on_a_later_callback_is_named_by_the_summary_and_holds_it(tmp_path, capsys):
    """logger=False, the first callback writes nowhere, the second has a log_dir: the summary names that directory."""
    asked = str(tmp_path / "asked")
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, log_dir=asked)
    _fit(tmp_path / "root", [NaNDetector(), windows], logger=False)
    assert _event_dirs(tmp_path) == [asked]  # what the file system saw
    assert windows.trace_files
    assert all(os.path.exists(p) for p in windows.trace_files)
    out = capsys.readouterr().out
    assert "logs: none" not in out
    assert f"tensorboard --logdir {asked}" in out
    assert "opkit/summary" in read_events(asked)[1]


def test_every_tensorboard_logger_gets_every_tag_and_the_summary_names_each(tmp_path, capsys):
    loggers = [pl.loggers.TensorBoardLogger(str(tmp_path), name=n) for n in ("a", "b")]
    _fit(tmp_path / "root", [NaNDetector(), ProfilerWindows(every_n_steps=2, warmup=0, active=1, export_trace=False)],
         logger=loggers)
    a, b = (read_events(str(tmp_path / n)) for n in ("a", "b"))
    assert len(a[0]) > 5
    assert set(a[0]) == set(b[0])  # every scalar tag in both
    assert set(a[1]) == set(b[1])  # every text tag, the summary among them
    assert "opkit/summary" in b[1]
    out = capsys.readouterr().out
    assert _event_dirs(tmp_path) == sorted(lg.log_dir for lg in loggers)
    for logger in loggers:
        assert f"tensorboard --logdir {logger.log_dir}" in out


def test_a_message_about_overrides_names_overrides_as_the_user_wrote_it(tmp_path):
    with pytest.raises(ValueError, match=r"PrecisionPolicy\(`overrides`\): 1 pattern\(s\) match no module"):
        _fit(tmp_path, [PrecisionPolicy(overrides={"layr": "fp32"})], logger=False)


def test_a_refusal_quotes_the_values_the_user_passed():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert TorchCompile(measure_speedup=False, measure=False).measure is False  # both say: time nothing
        with pytest.raises(ValueError, match=r"measure_speedup=True, measure=False"):
            TorchCompile(measure_speedup=True, measure=False)


# The tag reference (core/logging.py): every tag written is listed, and docs/tags.md is made from the list.


def test_a_tag_the_reference_does_not_list_warns_once(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False), log_dir=str(tmp_path))
    with pytest.warns(UnlistedTagWarning, match="scalar 'opkit/nan/evnets'.*core/logging.py does not list"):
        writer.scalar("opkit/nan/evnets", 1.0, 0)
    with pytest.warns(UnlistedTagWarning, match="text 'opkit/nan/events'"):  # listed as a scalar, not a text
        writer.text("opkit/nan/events", "x", 0)
    writer.scalar("opkit/profiler/matmul/self_ms", 1.0, 0)  # <class> families are listed once
    writer.close()


def _without_the_table(path: pathlib.Path) -> str:
    """The file's source, less the tag table's own lines (a tag listed there is not a tag written)."""
    text = path.read_text()
    tables = [n for n in ast.parse(text).body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
              getattr(getattr(n, "target", None) or n.targets[0], "id", "") == "TAGS"]
    lines = text.splitlines()
    for node in tables:
        lines[node.lineno - 1:node.end_lineno] = []
    return "\n".join(lines)


def test_the_tag_reference_page_is_made_from_the_list_and_each_listed_tag_is_written_somewhere():
    page = os.path.join(ROOT, "docs", "tags.md")
    with open(page) as f:
        assert f.read() == tags_markdown(), "docs/tags.md is stale: make docs-tags"
    package = pathlib.Path(lightning_opkit.__file__).parent
    source = "".join(_without_the_table(p) for p in package.rglob("*.py"))
    for tag in TAGS:  # its last part appears in the code that writes it, as the tag or as a scalar's key
        assert re.search(rf"[\"/']{re.escape(tag.name.rsplit('/', 1)[1])}[\"']", source), tag.name


def test_markdown_table_escapes_pipes_and_keeps_small_floats_visible():
    assert markdown_table(["x"], [["a|b"]]).splitlines()[-1] == "| a\\|b |"
    assert markdown_table(["x"], [[0.00012]]).splitlines()[-1] == "| 1.2e-04 |"  # not 0.000
    assert markdown_table(["x"], [[float("nan")]]).splitlines()[-1] == "| nan |"
