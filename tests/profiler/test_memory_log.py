"""What the memory view writes (profiler/memory_log.py), Trainer-free: a MemoryReport written through a real LogWriter
and read back with TensorBoard's EventAccumulator; the summary lines; the picture's bars."""

import lightning.pytorch as pl
from helpers import read_events, read_images

from lightning_opkit.core.logging import LogWriter
from lightning_opkit.profiler.memory import MemoryReport
from lightning_opkit.profiler.memory_log import blocks_figure, log_memory, memory_summary, out_of_memory_lines

_MB = 2**20


def _report():
    return MemoryReport(parameters=4 * _MB, gradients=4 * _MB, optimizer=8 * _MB, activations=6 * _MB, peak=30 * _MB,
                        activations_by_module={"h.0": 3 * _MB, "h.1": 3 * _MB},
                        activations_by_class={"matmul": 4 * _MB, "norm": 2 * _MB},
                        by_block_class={block: {"matmul": 2 * _MB, "norm": _MB} for block in ("h.0", "h.1")},
                        step=20)


def test_a_window_s_memory_is_read_back_from_the_event_files(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=str(tmp_path))
    log_memory(writer, _report(), step=20, top_k=3, window_no=1)
    writer.close()
    scalars, texts = read_events(str(tmp_path))
    assert {tag: values[-1] for tag, values in scalars.items() if tag.startswith("opkit/memory/")} == {
        f"opkit/memory/{k}": (20, float(v)) for k, v in _report().scalars().items() if v is not None}
    (step, modules), = texts["opkit/memory/modules"]
    assert step == 20
    assert "| optimizer state | 8.00 |" in modules
    assert "| peak | 30.00 |" in modules
    assert "matmul" in texts["opkit/memory/op_classes"][0][1]
    (image,) = read_images(str(tmp_path))["opkit/memory/blocks"]
    assert image[0] == 20
    assert image[1] > 100  # a real picture


def test_the_bars_stack_by_class_per_block_and_a_model_without_blocks_says_so():
    (axes,) = blocks_figure(_report(), "window 1").axes
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["matmul", "norm"]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["h.0", "h.1"]
    empty = MemoryReport(0, 0, 0, 0)
    (axes,) = blocks_figure(empty, "window 1").axes
    assert [t.get_text() for t in axes.texts] == ["no repeated blocks found in this model"]


def test_summary_and_out_of_memory_lines():
    lines = memory_summary(_report())
    assert lines[0] == ("  memory (step 20): parameters 4.0 MB, gradients 4.0, optimizer 8.0, activations 6.0,"
                        " peak 30.0")
    assert lines[1].startswith("  activations by module: h.0 3.00 MB")
    assert out_of_memory_lines(_report(), True, "/tmp/oom.pickle") == [
        "  out of memory: the memory lines above are the last window's (step 20)",
        "  memory snapshot: /tmp/oom.pickle (open it at https://pytorch.org/memory_viz)"]
    assert "before the first memory window" in out_of_memory_lines(None, True, None)[0]
