"""Out of memory told apart, and the CUDA allocation history (profiler/memory_snapshot.py): on a CPU nothing is
recorded and nothing written; a real CPU allocation failure is recognised."""

import pytest
import torch

from lightning_opkit.profiler.memory_snapshot import Snapshot, out_of_memory


def test_a_real_cpu_allocation_failure_is_out_of_memory_and_other_errors_are_not():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)  # more bytes than any machine has
    assert out_of_memory(caught.value)
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not out_of_memory(ValueError("can't allocate memory"))  # only the allocator's RuntimeError


def test_on_a_cpu_nothing_is_recorded_and_nothing_written(tmp_path):
    snapshot = Snapshot()
    assert snapshot.start("cpu") is False
    assert not snapshot.recording
    assert snapshot.dump(str(tmp_path / "oom.pickle")) is None
    assert list(tmp_path.iterdir()) == []
    snapshot.stop()
