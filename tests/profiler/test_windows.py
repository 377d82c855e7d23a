import gzip
import json
import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyNet, make_loader, read_events, snapshot, trainer

from examples.vit import ViTClassifier
from lightning_opkit.profiler import window_phase
from lightning_opkit.profiler.op_times import summarize
from lightning_opkit.profiler.windows import ProfilerWindows


class ProfilerState(pl.Callback):
    """Records, at every batch start and end, whether any profiler is running."""

    def __init__(self):
        self.states = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.states.append(torch.autograd.profiler._is_profiler_enabled)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append(torch.autograd.profiler._is_profiler_enabled)


def vit_loader(n=96, batch_size=8):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)), batch_size=batch_size)


def test_schedule_is_a_pure_function():
    phases = [window_phase(b, 5, 1, 2) for b in range(16)]
    assert [p for _, p in phases[:5]] == ["idle"] * 5
    assert phases[5:11] == [(0, "warmup"), (0, "active"), (0, "active"), (0, "idle"), (0, "idle"), (1, "warmup")]
    assert window_phase(15, 5, 0, 5) == (2, "active")


def test_three_windows_traces_scalars_tables_and_nothing_between(tmp_path):
    cb = ProfilerWindows(every_n_steps=4, warmup=1, active=2, top_k=5)
    state = ProfilerState()
    model = ViTClassifier(dim=16, depth=1)
    before = snapshot(model)
    trainer(tmp_path, [cb, state], max_steps=15).fit(model, vit_loader(n=160))
    assert cb.windows_done == 3
    # windows open at batches 4, 8, 12: one warmup batch, then two recorded ones; nothing runs otherwise
    starts = state.states[0::2]
    assert [b for b, on in enumerate(starts) if on] == [5, 6, 9, 10, 13, 14]
    assert not state.states[-1]
    assert not torch.autograd.profiler._is_profiler_enabled

    assert len(cb.trace_files) == 3
    for path in cb.trace_files:
        assert path.endswith(".pt.trace.json.gz")
        assert os.path.basename(path).startswith("rank0.")
        with gzip.open(path) as f:
            trace = json.load(f)
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"aten::addmm", "aten::_softmax", "aten::native_layer_norm", "aten::convolution"} <= names
    steps = sorted(int(os.path.basename(p).split(".")[1]) for p in cb.trace_files)
    assert steps == [7, 11, 15]

    scalars, texts = read_events(str(tmp_path))
    assert [s for s, _ in scalars["opkit/profiler/step_time_ms"]] == steps
    assert all(v > 0 for _, v in scalars["opkit/profiler/step_time_ms"])
    from lightning_opkit.opclass import OP_CLASSES
    charted = [c for c in OP_CLASSES if f"opkit/profiler/{c}/percent" in scalars]
    for i in range(3):
        total = sum(scalars[f"opkit/profiler/{c}/percent"][i][1] for c in charted)
        assert total == pytest.approx(100.0, abs=0.01)
    assert "opkit/profiler/rnn/percent" not in scalars
    assert "opkit/profiler/embedding/percent" not in scalars
    assert scalars["opkit/profiler/matmul/self_ms"][0][1] > 0
    table = texts["opkit/profiler/top_ops"][0][1]
    assert "| op | class | calls / step | self ms / step | total ms / step | % self |" in table
    assert table.count("\n| ") == 5 + 1
    assert "e+0" not in table
    assert "e-0" not in table
    assert table.startswith("Window 1: steps ")
    assert "\n| aten::" in table
    assert "matmul" in texts["opkit/profiler/op_classes"][0][1]
    assert snapshot(model) == before


def test_report_shares_match_the_profilers_self_time():
    model = ViTClassifier(dim=16, depth=1)
    x = torch.rand(8, 1, 8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    report = summarize(prof, [0.01], use_device=False)
    assert report.total_self_us == pytest.approx(sum(e.self_cpu_time_total for e in prof.key_averages()))
    assert sum(report.class_percent().values()) == pytest.approx(100.0)
    assert report.class_self_us["matmul"] > 0
    assert report.class_self_us["norm"] > 0


def test_validation_cuts_a_window_which_is_reported_as_partial(tmp_path):
    cb = ProfilerWindows(every_n_steps=4, warmup=0, active=4, gzip=False)
    state = ProfilerState()
    # validation after every 6 batches cuts the window opened at batch 4 after 2 recorded steps
    trainer(tmp_path, [state, cb], max_steps=8, limit_val_batches=1, val_check_interval=6).fit(
        TinyNet(), make_loader(n=80), make_loader(n=8))
    assert cb.windows_done == 1
    assert cb.last_report.steps == 2
    assert cb.trace_files[0].endswith(".pt.trace.json")
    assert "cut short)" in read_events(str(tmp_path))[1]["opkit/profiler/top_ops"][0][1]
    assert not torch.autograd.profiler._is_profiler_enabled


def test_max_steps_inside_a_window_closes_it(tmp_path):
    cb = ProfilerWindows(every_n_steps=3, warmup=0, active=3)
    trainer(tmp_path, [cb], max_steps=4).fit(TinyNet(), make_loader())
    assert cb.windows_done == 1
    assert cb.last_report.steps == 1
    assert not torch.autograd.profiler._is_profiler_enabled


def test_window_cut_in_warmup_is_dropped(tmp_path):
    cb = ProfilerWindows(every_n_steps=3, warmup=2, active=1)
    trainer(tmp_path, [cb], max_steps=4).fit(TinyNet(), make_loader())
    assert cb.windows_done == 0
    assert cb.trace_files == []
    assert not torch.autograd.profiler._is_profiler_enabled


def test_exception_inside_a_window_stops_the_profiler(tmp_path):
    class Boom(TinyNet):
        def training_step(self, batch, batch_idx):
            if self.global_step == 4:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [ProfilerWindows(every_n_steps=2, warmup=0, active=2)], max_steps=8).fit(
            Boom(), make_loader())
    assert not torch.autograd.profiler._is_profiler_enabled


def test_memory_and_flops(tmp_path):
    cb = ProfilerWindows(every_n_steps=2, warmup=0, active=1, profile_memory=True, with_flops=True,
                         record_shapes=True, export_trace=False)
    trainer(tmp_path, [cb], max_steps=3).fit(ViTClassifier(dim=16, depth=1), vit_loader())
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/profiler/peak_memory_mb"][0][1] > 0
    assert scalars["opkit/profiler/gflops_per_s"][0][1] > 0
    assert "GFLOP" in texts["opkit/profiler/top_ops"][0][1]
    assert cb.trace_files == []


def test_keep_traces_keeps_the_newest(tmp_path):
    cb = ProfilerWindows(every_n_steps=2, warmup=0, active=1, keep_traces=2)
    trainer(tmp_path, [cb], max_steps=8).fit(TinyNet(), make_loader())
    files = sorted(os.listdir(os.path.dirname(cb.trace_files[0])))
    assert cb.windows_done == 3
    assert len(files) == 2
    assert files == sorted(os.path.basename(p) for p in cb.trace_files[-2:])


def test_resume_continues_the_window_count(tmp_path):
    cb = ProfilerWindows(every_n_steps=3, warmup=0, active=1)
    t = trainer(tmp_path, [cb], max_epochs=1)
    t.fit(TinyNet(), make_loader(n=56))  # 7 batches: windows at batches 3 and 6
    assert (cb.windows_done, cb.batches_seen) == (2, 7)
    ckpt = os.path.join(tmp_path, "r.ckpt")
    t.save_checkpoint(ckpt)
    resumed = ProfilerWindows(every_n_steps=3, warmup=0, active=1)
    trainer(tmp_path, [resumed], max_epochs=2).fit(TinyNet(), make_loader(n=56), ckpt_path=ckpt)
    # batches 7..13 of the run: windows at 9 and 12, counted on from 2
    assert (resumed.windows_done, resumed.batches_seen) == (4, 14)
    assert sorted(int(os.path.basename(p).split(".")[1]) for p in resumed.trace_files) == [10, 13]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(active=0), "`active`.*>= 1.*0"),
        (dict(warmup=-1), "`warmup`"),
        (dict(every_n_steps=4, warmup=2, active=3), "warmup.*active.*every_n_steps`=4"),
        (dict(top_k=0), "`top_k`"),
        (dict(every_n_steps=-1), "`every_n_steps`"),  # 0 is off (tests/core/test_checks.py)
    ],
)
def test_impossible_windows(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfilerWindows(**kwargs)


def test_epoch_end_cuts_a_window_and_the_next_epoch_opens_the_next(tmp_path):
    cb = ProfilerWindows(every_n_steps=4, warmup=0, active=3)
    state = ProfilerState()
    # 5 batches per epoch: the window opened at batch 4 (the epoch's last) is closed at the epoch end with 1 step
    trainer(tmp_path, [cb, state], max_epochs=2).fit(TinyNet(), make_loader(n=40))
    assert cb.windows_done == 2
    assert cb.last_report.steps == 2
    steps = sorted(int(os.path.basename(p).split(".")[1]) for p in cb.trace_files)
    assert steps == [5, 10]
    assert [b for b, on in enumerate(state.states[0::2]) if on] == [4, 8, 9]


@pytest.mark.parametrize("every,warmup,active", [(5, 1, 2), (2, 0, 2), (3, 1, 2), (4, 0, 1)])
def test_one_schedule_drives_torch_profiler_as_torch_own_schedule_would(every, warmup, active):
    # The window's torch.profiler schedule is read off window_phase; it must be torch's own schedule(wait=0, warmup,
    # active, repeat=1), also when a window fills its whole period (the next one must not begin inside it).
    from lightning_opkit.profiler.session import _profiler_schedule

    ours = _profiler_schedule(every, warmup, active)
    torchs = torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1)
    assert [ours(s) for s in range(3 * every)] == [torchs(s) for s in range(3 * every)]


def test_what_began_once_a_window_was_settling_its_collectives_is_no_part_of_the_window():
    # under gloo the window's last batch ends in a barrier (settle_collectives) still recorded: it is not the step's
    from lightning_opkit.profiler.op_times import summarize, window_events
    from lightning_opkit.profiler.roofline.work import class_rooflines
    from lightning_opkit.profiler.session import SETTLE

    x = torch.randn(64, 64)
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        x @ x
        with torch.profiler.record_function(SETTLE):
            torch.relu(x @ x)
    names = [e.name for e in prof.events()]
    assert names.count("aten::mm") == 2  # recorded ...
    assert "aten::relu" in names
    kept = [e.name for e in window_events(prof)]
    assert kept.count("aten::mm") == 1  # ... not the window's
    assert "aten::relu" not in kept
    assert SETTLE not in kept
    report = summarize(prof, [1e-3], use_device=False)
    assert [r.calls for r in report.ops if r.name == "aten::mm"] == [1]
    assert not [r for r in report.ops if r.name == "aten::relu"]
    assert class_rooflines(prof)["matmul"].calls == 1
