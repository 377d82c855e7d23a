"""What NaNDetector does about a report (nan/actions.py), on a Trainer that never fits: skip up to the limit then
raise, warn once per kind of fault while counting each, stop, and the repair of a precision fault, kept in state."""

import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import read_events
from torch import nn

from lightning_opkit import NonFiniteError
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.warn import OpkitWarning, new_run
from lightning_opkit.nan.actions import Actions
from lightning_opkit.nan.report import Cause, NaNReport, Origin
from lightning_opkit.nan.skip import BatchState, StepSkipper


def _report(module="1", cause="data_or_model"):
    return NaNReport(3, 0, 3, 0, Origin(phase="forward", module=module, module_type="Linear"),
                     Cause(cause, "why"), "skip")


class _Written:
    """The reports written to TensorBoard so far, read back from the event files with EventAccumulator."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return len(read_events(self.folder)[1].get("opkit/nan/report", []))


def _actions(action, limit=2, repair=True):
    skipper = StepSkipper(Patches())
    actions = Actions(action, limit, repair, skipper)
    folder = tempfile.mkdtemp()
    actions.writer = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=folder)
    return actions, skipper, _Written(folder)


@pytest.fixture
def trainer():
    new_run()  # each test's warnings said afresh
    return pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def test_skip_leaves_the_step_out_counts_and_raises_past_the_limit(trainer):
    actions, skipper, logged = _actions("skip", limit=2)
    for _ in range(2):
        skipper.begin_batch(checking=True, save_buffers=False)
        actions.act(trainer, nn.Linear(2, 2), _report())
        assert skipper.state is BatchState.SKIP_PENDING
    assert (actions.skipped_steps, actions.consecutive_skips, len(logged)) == (2, 2, 2)
    with pytest.raises(NonFiniteError, match="skipped 2 steps in a row"):
        actions.act(trainer, nn.Linear(2, 2), _report())
    assert len(actions.reports) == len(logged) == 3  # the one that raised is kept and written too
    actions.good_step()
    assert actions.consecutive_skips == 0
    assert actions.goes_on


def test_warn_says_a_fault_once_and_counts_every_one(trainer):
    actions, _, logged = _actions("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            actions.act(trainer, nn.Linear(2, 2), _report())
        actions.act(trainer, nn.Linear(2, 2), _report(module="0"))  # another module: said too
    said = [w for w in caught if issubclass(w.category, OpkitWarning)]
    assert len(said) == 2
    assert "The optimizer step was skipped." in str(said[0].message)
    assert actions.skipped_steps == len(logged) == 4


def test_stop_ends_the_run_after_leaving_the_step_out(trainer):
    actions, skipper, _ = _actions("stop")
    actions.act(trainer, nn.Linear(2, 2), _report())
    assert trainer.should_stop
    assert skipper.state is BatchState.SKIP_PENDING


def test_a_precision_fault_pins_its_culprit_and_the_pin_survives_the_state_round_trip(trainer):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).half()
    actions, _, _ = _actions("skip")
    actions.act(trainer, model, _report(cause="precision"))
    assert actions.reports[-1].repair == "1 -> fp32"
    assert model(torch.ones(1, 2, dtype=torch.half)).dtype == torch.half  # fp32 inside, handed on in fp16
    assert "repaired" in actions.repairs_line()
    again, _, _ = _actions("skip")
    again.load_state_dict(actions.state_dict())
    assert again.repairs.pinned == {"1": "fp32"}
    assert again.reports == actions.reports
    actions.act(trainer, model, _report(cause="precision"))  # the pin did not hold: not pinned again
    assert actions.reports[-1].repair is None
    actions.repairs.release()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_raise_raises_with_the_report_and_repairs_nothing(trainer):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    actions, skipper, logged = _actions("raise")
    with pytest.raises(NonFiniteError) as caught:
        actions.act(trainer, model, _report(cause="precision"))
    assert caught.value.report["module"] == "1"
    assert len(logged) == 1
    assert actions.repairs.pinned == {}  # the run does not go on: nothing to repair for


def test_each_report_is_written_with_the_run_s_counters(trainer):
    actions, skipper, written = _actions("skip", limit=5)
    for _ in range(2):
        skipper.begin_batch(checking=True, save_buffers=False)
        actions.act(trainer, nn.Linear(2, 2), _report())
    scalars, _ = read_events(written.folder)
    assert scalars["opkit/nan/skipped_steps"][-1][1] == 2.0
    assert scalars["opkit/nan/events"][-1][1] == 2.0
    assert "opkit/nan/dead_parameters" not in scalars  # no dead-parameter watch: no such counter
    assert actions.counters() == {"events": 2, "skipped_steps": 2, "consecutive_skips": 2, "repairs": 0, "spikes": 0,
                                  "dead_parameters": None}


def test_the_report_kept_carries_the_action_taken():
    actions, skipper, _ = _actions("warn")
    report = NaNReport(3, 0, 3, 0, Origin(phase="forward", module="1"), Cause("data_or_model", "why"))
    assert report.action == "raise"  # as a replay builds it: the default
    skipper.begin_batch(checking=True, save_buffers=False)
    with pytest.warns(OpkitWarning):
        actions.act(pl.Trainer(logger=False, enable_progress_bar=False), nn.Linear(2, 2), report)
    assert actions.reports[-1].action == "warn"
