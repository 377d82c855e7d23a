"""channels_last against contiguous at a model's own convolutions (profiler/roofline/layout_speed.py): the two
timed runs do the same work."""

import torch

from lightning_opkit.profiler.roofline.layout_speed import _step


def test_both_layouts_timed_compute_the_same_gradients():
    # the comparison is fair only if the two runs do the same work: the same convolution, in two layouts
    arguments = [[2, 2], [1, 1], [1, 1], False, [0, 0], 2]
    torch.manual_seed(0)
    contiguous = _step([[4, 8, 16, 16], [16, 4, 3, 3], [16]], arguments, torch.float32, torch.device("cpu"), False)
    torch.manual_seed(0)
    channels_last = _step([[4, 8, 16, 16], [16, 4, 3, 3], [16]], arguments, torch.float32, torch.device("cpu"), True)
    for a, b in zip(contiguous(), channels_last(), strict=True):
        torch.testing.assert_close(a, b)
    assert channels_last()[0].is_contiguous(memory_format=torch.channels_last)
    assert not contiguous()[0].is_contiguous(memory_format=torch.channels_last)
