"""Spike statistics (nan/spike.py) without a Trainer: a falling loss never alarms, a jump does, the floor keeps a
converged run quiet, the window survives a checkpoint, and a departure is found where the spiked batch departs."""

import math

import torch
from torch import nn

from lightning_opkit.nan.check import log_values
from lightning_opkit.nan.spike import DEPARTS, SpikeWatch, departures


def _loss(x):
    return log_values(x, 1.0)[0]


def test_a_loss_falling_by_an_order_of_magnitude_never_scores_high_and_a_jump_does():
    watch = SpikeWatch(window=100)
    scores = []
    for step in range(200):
        loss = 10.0 * math.exp(-step / 70) * (1 + 0.05 * math.sin(step))  # 10 down to 0.6, noisy
        scores.append(watch.scores((_loss(loss), 0.0))[0])
        watch.record((_loss(loss), 0.0))
    assert max(scores) < 6
    assert watch.scores((_loss(loss * 5), 0.0))[0] > 6


def test_nothing_is_judged_while_warming_up():
    watch = SpikeWatch(window=100)
    for _ in range(watch.warmup - 1):
        watch.record((_loss(1.0), 0.0))
    assert not watch.ready
    assert watch.scores((_loss(1000.0), 0.0)) == (0.0, 0.0)


def test_a_converged_loss_a_few_percent_up_stays_under_the_floor():
    watch = SpikeWatch(window=50)
    for _ in range(50):
        watch.record((_loss(0.3), math.log(2.0)))
    loss_z, grad_z = watch.scores((_loss(0.3 * 1.05), math.log(2.0 * 1.2)))
    assert 0 < loss_z < 6
    assert 0 < grad_z < 6


def test_the_window_comes_back_from_a_checkpoint_and_scores_alike():
    watch = SpikeWatch(window=30)
    for step in range(40):
        watch.record((_loss(1.0 + 0.01 * (step % 4)), 0.1 * (step % 3)))
    again = SpikeWatch(window=30)
    again.load_state_dict(watch.state_dict())
    assert again.scores((_loss(5.0), 2.0)) == watch.scores((_loss(5.0), 2.0))


def test_departures_name_the_module_whose_output_moved_on_the_spiked_batch():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    rng = (torch.get_rng_state(), None)
    x = torch.ones(2, 4)
    ratios = departures(model, (lambda: model(x * 100).sum(), rng), (lambda: model(x).sum(), rng),
                        list(model.named_modules()))
    moved = [path for path, r in ratios if abs(math.log(r)) > math.log(DEPARTS)]
    assert moved[0] == "" or moved[0] == "0"  # the root's output and the first Linear's both moved; forward order
    assert "0" in moved
    assert not model._forward_hooks
    assert not model[0]._forward_hooks
