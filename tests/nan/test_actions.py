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
from lightning_opkit.nan.actions import Actions, BatchState, StepSkipper
from lightning_opkit.nan.report import Cause, NaNReport, Origin


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


# What a skipped step leaves (nan/actions.py), without a Trainer: weights, Adam's state, buffers and the LR schedule
# as they were; a later optimizer of the same batch left out too; the patches undone.


def _trained(model, opt):
    """One step of ``model`` (with BatchNorm) on a batch, through the closure as Lightning calls it."""

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        return loss

    return opt.step(closure)


def _state(model, opt, scheduler):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()} for k, s in opt.state.items()},
            scheduler.last_epoch, [g["lr"] for g in opt.param_groups])


def _same(a, b):
    weights_a, opt_a, epoch_a, lr_a = a
    weights_b, opt_b, epoch_b, lr_b = b
    moments = [(opt_a[p][n], opt_b[p][n]) for p in opt_a for n in opt_a[p] if torch.is_tensor(opt_a[p][n])]
    return (all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a) and epoch_a == epoch_b and lr_a == lr_b
            and all(torch.equal(x, y) for x, y in moments))


def test_a_skipped_step_leaves_weights_optimizer_state_buffers_and_schedule_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    patches = Patches()
    skipper = StepSkipper(patches)
    own_step = vars(opt).get("step")  # the LR scheduler's wrapper, on some releases
    skipper.wrap_optimizer(opt)
    skipper.watch_buffers(list(model.buffers()))
    skipper.watch_schedulers([(scheduler, opt)])
    _trained(model, opt)  # Adam has state now
    scheduler.step()
    before = _state(model, opt, scheduler)

    skipper.begin_batch(checking=True, save_buffers=True)
    assert skipper.state is BatchState.CHECKING

    def closure():  # the check fails inside the closure (NaNDetector's on_before_optimizer_step)
        loss = model(torch.randn(8, 4)).square().mean()  # the forward moved BatchNorm's running statistics
        loss.backward()
        skipper.leave_out_step()
        return loss

    opt.step(closure)
    scheduler.step()  # a user's manual step advances the schedule; the batch's end puts it back
    skipper.restore_buffers()
    assert skipper.state is BatchState.SKIPPED
    assert skipper.step_left_out
    assert all(p.grad is None for p in model.parameters())  # with accumulation they would add up
    opt.step()  # a second optimizer step in the same batch (manual optimization) goes with it
    skipper.end_batch()
    assert _same(before, _state(model, opt, scheduler))

    skipper.begin_batch(checking=False, save_buffers=False)  # the next batch steps as usual
    _trained(model, opt)
    assert not _same(before, _state(model, opt, scheduler))
    patches.restore()
    assert vars(opt).get("step") is own_step


def test_buffers_are_put_back_on_the_device_only_where_the_flag_is_set():
    buffer = torch.zeros(3)
    skipper = StepSkipper(Patches())
    skipper.watch_buffers([buffer])
    skipper.begin_batch(checking=True, save_buffers=True)
    buffer.add_(1.0)
    skipper.restore_buffers_where(torch.zeros(()))
    assert buffer.tolist() == [1.0, 1.0, 1.0]  # a good step keeps what its forward wrote
    skipper.restore_buffers_where(torch.ones(()))
    assert buffer.tolist() == [0.0, 0.0, 0.0]
