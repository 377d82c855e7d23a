"""Run a training step again without a trace (core/replay.py): buffers, metric states, RNG and .grad put back, logging
silenced, the replay's scope visible to the user's code."""

import copy

import torch
import torchmetrics
from torch import nn

from lightning_opkit.core.replay import loss_of, preserved, quiet_logging, replaying, rng_state, run_step, set_rng_state


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.acc = torchmetrics.MeanMetric()
        self.seen_replaying = []

    def forward(self, x):
        self.seen_replaying.append(replaying())
        out = self.drop(self.bn(self.lin(x)))
        self.acc.update(out.detach().mean())
        return out


def test_run_step_returns_loss_and_gradients_and_leaves_no_trace():
    torch.manual_seed(0)
    net = _Net()
    twin = copy.deepcopy(net)
    x = torch.randn(8, 4)
    grad_before = torch.full_like(net.lin.weight, 7.0)
    net.lin.weight.grad = grad_before.clone()
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    loss, grads = run_step(net, lambda: net(x).square().mean())
    # the same step trained plainly, from the same RNG state, on a copy: the same loss and gradients
    torch.set_rng_state(rng)
    expected = twin(x).square().mean()
    expected.backward()
    assert torch.equal(loss, expected.detach())
    assert not loss.requires_grad
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, twin.parameters(), strict=True))
    assert torch.equal(net.lin.weight.grad, grad_before)  # .grad untouched
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), buffers, strict=True))  # BatchNorm stats back
    assert net.acc.update_count == 0  # the metric's update undone
    assert twin.acc.update_count == 1
    assert net.seen_replaying == [True]
    assert not replaying()


def test_the_same_rng_state_replays_the_same_dropout_mask():
    torch.manual_seed(1)
    net = _Net()
    x = torch.randn(8, 4)
    state = rng_state()
    first, _ = run_step(net, lambda: net(x).sum(), backward=False)
    set_rng_state(state)
    second, _ = run_step(net, lambda: net(x).sum(), backward=False)
    assert torch.equal(first, second)


def test_preserved_hands_out_a_reset_between_two_runs():
    bn = nn.BatchNorm1d(2)
    with preserved(bn) as reset:
        bn(torch.randn(4, 2))
        assert bn.running_mean.abs().sum() > 0
        reset()
        assert bn.running_mean.tolist() == [0.0, 0.0]
        bn(torch.randn(4, 2))
    assert bn.running_mean.tolist() == [0.0, 0.0]


def test_quiet_logging_silences_log_and_log_dict_and_puts_them_back():
    calls = []

    class Module(nn.Module):
        def log(self, *args, **kwargs):
            calls.append(("log", args))

        def log_dict(self, *args, **kwargs):
            calls.append(("log_dict", args))

    module = Module()
    with quiet_logging(module):
        module.log("a", 1)
        module.log_dict({"b": 2})
    assert calls == []
    module.log("a", 1)
    assert calls == [("log", ("a", 1))]
    assert "log" not in vars(module)


def test_loss_of_reads_a_tensor_a_dict_and_an_output_object():
    t = torch.tensor(2.0)

    class Out:
        loss = t

    assert loss_of(t) is t
    assert loss_of({"loss": t}) is t
    assert loss_of(Out()) is t
    assert loss_of({"logits": t}) is None
    assert loss_of(None) is None
