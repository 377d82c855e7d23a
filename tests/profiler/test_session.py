"""One profiler window (profiler/session.py), Trainer-free: the schedule's phases, a Window stepped batch by batch
records exactly its active batches (counted in the trace by a record_function per batch), its times, and frees it."""

import os
import sys

import torch

from lightning_opkit.profiler.session import (
    Window,
    ends_recording,
    opens_window,
    quiet_stderr,
    settle_collectives,
    settler,
    window_phase,
)


def test_the_phases_repeat_every_period_and_the_first_period_is_never_profiled():
    phases = [window_phase(b, 5, 1, 2) for b in range(16)]
    assert [p for _, p in phases[:5]] == ["idle"] * 5
    assert phases[5:10] == [(0, "warmup"), (0, "active"), (0, "active"), (0, "idle"), (0, "idle")]
    assert phases[10:13] == [(1, "warmup"), (1, "active"), (1, "active")]
    assert [b for b in range(16) if opens_window(b, 5)] == [5, 10, 15]
    assert [b for b in range(16) if ends_recording(b, 5, 1, 2)] == [7, 12]
    assert settler(7, 5, 1, 2) is settle_collectives
    assert settler(6, 5, 1, 2) is None
    assert settle_collectives() is False  # no process group: nothing to wait for


def test_a_window_records_its_active_batches_only_and_times_them():
    window = Window(every_n_steps=4, warmup=1, active=2, options={})
    for batch in range(4, 8):  # a window opened at batch 4: warmup, active, active, idle
        phase = window_phase(batch, 4, 1, 2)[1]
        window.begin_batch(phase)
        with torch.profiler.record_function(f"batch {batch}"):
            torch.ones(16, 16) @ torch.ones(16, 16)
        window.end_batch()
        if window.ready:
            break
    assert window.ready
    names = {e.name for e in window.prof.events()}
    assert {n for n in names if n.startswith("batch ")} == {"batch 5", "batch 6"}
    assert len(window.step_times) == 2
    assert all(t > 0 for t in window.step_times)
    window.stop()
    window.release()
    assert window.prof is None


def test_quiet_stderr_silences_file_descriptor_2_and_gives_it_back(capfd):
    with quiet_stderr():
        os.write(2, b"kineto noise\n")
    os.write(2, b"after\n")
    sys.stderr.flush()
    assert capfd.readouterr().err == "after\n"
