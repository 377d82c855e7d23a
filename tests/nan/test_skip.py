"""What a skipped step leaves (nan/skip.py), without a Trainer: weights, Adam's state, buffers and the LR schedule
as they were; a later optimizer of the same batch left out too; the patches undone."""

import torch
from torch import nn

from lightning_opkit.core.patch import Patches
from lightning_opkit.nan.skip import BatchState, StepSkipper


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
