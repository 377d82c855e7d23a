"""What a user sees: the run summary, the custom-scalars layout, a quiet console during profiler windows."""

import re

import pytest
from helpers import TinyNet, make_loader, read_events, read_layout, trainer
from zoo import build

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.core.summary import merged_layout


def _all_four():
    return [PrecisionPolicy(census_every_n_steps=2), NaNDetector(action="skip"),
            ProfilerWindows(every_n_steps=2, warmup=0, active=1), TorchCompile(modules=["body"], backend="eager")]


def test_summary_is_printed_once_and_logged(tmp_path, capsys):
    trainer(tmp_path, _all_four(), max_steps=5).fit(TinyNet(forward_steps=(3,)), make_loader())
    out = capsys.readouterr().out
    assert out.count("opkit run summary (fit finished, global step 5)") == 1
    log_dir = re.search(r"tensorboard --logdir (\S+)", out).group(1)
    assert log_dir == str(tmp_path / "lightning_logs" / "version_0")
    assert "NaN/Inf: 1 event(s), 1 skipped step(s)" in out
    assert "first at step 3: forward in 'body.1'" in out
    assert "profiler: 2 window(s)" in out
    assert "last window's top op classes:" in out
    assert "compile (eager):" in out
    assert "regions: body" in out
    assert "precision policy: matmul" in out
    _, texts = read_events(str(tmp_path))
    assert "opkit run summary" in texts["opkit/summary"][-1][1]


def test_summary_on_an_exception(tmp_path, capsys):
    with pytest.raises(NonFiniteError):
        trainer(tmp_path, [NaNDetector(action="raise"), ProfilerWindows(every_n_steps=2, warmup=0, active=1)],
                max_steps=5).fit(TinyNet(forward_steps=(3,)), make_loader())
    out = capsys.readouterr().out
    assert out.count("opkit run summary (ended by NonFiniteError") == 1
    assert "NaN/Inf: 1 event(s)" in out


def test_custom_scalars_layout_names_the_opkit_charts(tmp_path):
    model = build("torch_encoder")
    trainer(tmp_path, _all_four()[:3], max_steps=5).fit(model, model.loader())
    layout = read_layout(str(tmp_path))
    # each attached callback contributes its own charts: no TorchCompile here, so no empty compile charts
    assert set(layout) == {"opkit profiler", "opkit precision", "opkit nan"}
    assert layout["opkit profiler"]["op-class share of profiled self time (%)"] == [r"opkit/profiler/[a-z]+/percent"]
    scalars, _ = read_events(str(tmp_path))
    charted = {t.split("/")[2] for t in scalars if re.fullmatch(r"opkit/profiler/[a-z]+/percent", t)}
    assert "matmul" in charted
    assert "conv" not in charted
    assert "rnn" not in charted
    for charts in layout.values():  # every chart's tags are ones opkit writes
        for regexes in charts.values():
            assert all(r.startswith("opkit/") for r in regexes)


def test_profiler_windows_keep_the_console_quiet(tmp_path, capfd):
    trainer(tmp_path, [ProfilerWindows(every_n_steps=2, warmup=0, active=1)], max_steps=5).fit(
        TinyNet(), make_loader())
    captured = capfd.readouterr()
    assert "USDT" not in captured.err
    assert "profiler_start" not in captured.err + captured.out


@pytest.mark.slow
def test_compiled_code_is_named_and_classified_in_profiles(tmp_path):
    # The example under regional Inductor: fused kernels classified by the ops they fuse, regions named.
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from examples.vit import ViTClassifier, load_digits_tensors

    x, y = load_digits_tensors()
    windows = ProfilerWindows(every_n_steps=6, warmup=1, active=3)
    compiler = TorchCompile(modules=["model.blocks.*"], measure=False)  # inductor, kept compiled under load
    trainer(tmp_path, [windows, compiler], max_steps=10).fit(
        ViTClassifier(depth=2), DataLoader(TensorDataset(x[:640], y[:640]), batch_size=64))
    report = windows.last_report
    fused = [r for r in report.ops if "cpp_fused" in r.name]
    assert fused
    assert all(r.op_class != "other" for r in fused), [(r.name, r.op_class) for r in fused]
    assert report.class_percent()["other"] < 5, sorted((r.self_us, r.name) for r in report.ops
                                                       if r.op_class == "other")[-5:]
    assert set(report.region_total_us) == {"model.blocks.0", "model.blocks.1"}
    _, texts = read_events(str(tmp_path))
    assert "| model.blocks.0 |" in texts["opkit/profiler/op_classes"][-1][1]
    assert torch._inductor.config.cpp.enable_kernel_profile is False  # restored after fit


def test_the_layout_holds_every_callback_s_charts_each_tag_once(tmp_path):
    windows, compiler, detector = ProfilerWindows(every_n_steps=4), TorchCompile(backend="eager"), NaNDetector()
    layout = merged_layout(trainer(tmp_path, [windows, compiler, detector], max_steps=1))
    own = {**windows.layout(), **compiler.layout(), **detector.layout()}
    assert set(layout) == set(own) == {"opkit profiler", "opkit compile", "opkit nan"}
    for category, charts in own.items():
        assert layout[category] == charts
    assert merged_layout(trainer(tmp_path, [compiler], max_steps=1)) == compiler.layout()


# Without a fit: the summary from a Trainer and writers as they stand


def test_the_summary_names_where_the_logs_are_or_that_there_are_none(tmp_path, capsys):
    import lightning.pytorch as pl

    from lightning_opkit.core.logging import LogWriter
    from lightning_opkit.core.summary import report

    for log_dir in (None, str(tmp_path)):
        detector = NaNDetector(log_dir=log_dir)
        bare = pl.Trainer(logger=False, callbacks=[detector], enable_progress_bar=False, enable_model_summary=False)
        assert report(bare, detector, None) is None  # never set up for a fit: no summary
        assert report(bare, ProfilerWindows(), LogWriter(bare)) is None  # not the Trainer's first opkit callback
        writer = detector._open_writer(bare, "fit")  # what its setup opens
        text = report(bare, detector, writer, exception=RuntimeError("boom") if log_dir else None)
        assert text in capsys.readouterr().out
        if log_dir is None:  # logger=False and no log_dir: nothing written
            assert "logs: none (the Trainer has no logger" in text
            assert not list(tmp_path.iterdir())
    assert text.startswith("opkit run summary (ended by RuntimeError: boom, global step 0)")
    assert f"tensorboard --logdir {tmp_path}" in text
    assert "logs: none" not in text
