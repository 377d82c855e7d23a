"""A window's trace file (profiler/traces.py): written where TensorBoard's profiler plugin reads it, readable as
Chrome-trace JSON, the oldest dropped past the limit."""

import gzip
import json
import pathlib

import torch

from lightning_opkit.profiler.traces import write_trace, write_trace_or_warn


def _profile():
    with torch.profiler.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    return prof


def test_the_trace_is_named_by_rank_and_step_and_holds_the_recorded_ops(tmp_path):
    written: list[str] = []
    seconds = write_trace(_profile(), str(tmp_path / "traces"), rank=1, step=30, gzip=False, written=written, keep=None)
    assert seconds >= 0
    assert written == [str(tmp_path / "traces" / "rank1.30.pt.trace.json")]
    names = {e.get("name") for e in json.loads(pathlib.Path(written[0]).read_text())["traceEvents"]}
    assert "aten::mm" in names


def test_gzipped_and_only_the_newest_kept(tmp_path):
    written: list[str] = []
    for step in (10, 20, 30):
        write_trace(_profile(), str(tmp_path), rank=0, step=step, gzip=True, written=written, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.20.pt.trace.json.gz", "rank0.30.pt.trace.json.gz"]
    assert written == [str(tmp_path / "rank0.20.pt.trace.json.gz"), str(tmp_path / "rank0.30.pt.trace.json.gz")]
    with gzip.open(written[-1], "rt") as f:
        assert "traceEvents" in json.load(f)


def test_a_trace_that_cannot_be_written_is_a_warning_and_none_not_an_exception(tmp_path):
    import pytest

    blocker = tmp_path / "a file"
    blocker.write_text("in the way of the folder")
    written: list[str] = []
    with pytest.warns(UserWarning, match="could not write the trace of the window at step 7 .* training goes on"):
        assert write_trace_or_warn(_profile(), str(blocker / "traces"), 0, 7, False, written, None) is None
    assert written == []
    assert write_trace_or_warn(_profile(), str(tmp_path / "ok"), 0, 8, False, written, None) > 0
    assert len(written) == 1
