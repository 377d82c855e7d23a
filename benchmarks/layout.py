"""channels_last against contiguous: the roofline's conv-only measurement beside the whole training step it predicts.

For ResNet-style CNNs at a few widths (a stem and 4 basic blocks of ``C`` channels, BatchNorm, ReLU, on 32 images of
56 x 56), the roofline's layout fact (``conv_layout_speed``: the window's costliest convolutions timed forward and
backward in both layouts) is taken from one profiled step; then whole training steps (forward, backward, SGD) run in
both layouts, interleaved in one process (A B A B ...), medians and ratios. The fact times the convolutions only;
the step also pays BatchNorm, ReLU and the residual adds in the layout, and the first conversion of the input.

    python benchmarks/layout.py --reps 7 --widths 32 64 128
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_opkit.profiler.roofline.layout_speed import conv_layout, conv_layout_speed  # noqa: E402


def cnn(width: int, batch: int, size: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from zoo import BasicBlock

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                          *[BasicBlock(width) for _ in range(4)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(width, 10))
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(0))
    return model, x, y


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=56)
    args = parser.parse_args()
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads,"
          f" torch {torch.__version__}")
    print(f"ResNet-style CNN, {args.batch} x 3 x {args.size} x {args.size}, fp32, CPU; ratio: channels_last time /"
          " contiguous time (below 1: channels_last faster)")
    for width in args.widths:
        models = {}
        for layout in ("contiguous", "channels_last"):
            model, x, y = cnn(width, args.batch, args.size)
            if layout == "channels_last":
                model.to(memory_format=torch.channels_last)
            assert conv_layout(model) == layout
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step(model=model, x=x, y=y, optimizer=optimizer) -> None:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()

            step()  # warm-up: oneDNN primitives, allocator
            models[layout] = step
        with torch.profiler.profile(record_shapes=True) as prof:
            models["contiguous"]()
        fact = conv_layout_speed(prof, "cpu", window=1)
        times: dict[str, list[float]] = {layout: [] for layout in models}
        for _ in range(args.reps):
            for layout, step in models.items():
                began = time.perf_counter()
                step()
                times[layout].append(time.perf_counter() - began)
        median = {layout: statistics.median(t) for layout, t in times.items()}
        assert fact is not None
        print(f"  width {width:4d}: roofline's conv fact {fact.ratio:.3f}   whole step"
              f" {1e3 * median['contiguous']:.1f} -> {1e3 * median['channels_last']:.1f} ms"
              f" ({median['channels_last'] / median['contiguous']:.3f})")


if __name__ == "__main__":
    main()
