"""float8 GEMMs against bf16 and fp32 here: a Llama-style MLP's training step, interleaved, medians and ratios.

One MLP (``d -> 4d``, GELU, ``4d -> d``) and its backward, at ``--width`` (d_model) on ``--tokens`` tokens: fp32, bf16
(the weights' GEMMs under autocast) and float8 (the policy's ``"fp8"``: torchao's dynamic scaling, the recipe named),
in the order A B C C B A per repetition so drift hits each alike; per variant the median step over repetitions, and
each one's time over fp32's. On a CPU there are no float8 units: this says what fp8 costs there (the kit's tests run
it there, ``rules="auto"`` never picks it), not what it gains on an H100.

    python benchmarks/fp8.py                      # d_model 256, 128 tokens: about 30 s on 2 CPU cores
    python benchmarks/fp8.py --width 4096 --tokens 8192 --device cuda   # where float8 units are

On a CPU torch's float8 GEMM is a reference kernel: about 1400x fp32's time at d_model 256 (3 s a step), 1600x at
512, so the CPU defaults are small.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_opkit.core.timing import sync  # noqa: E402
from lightning_opkit.precision.dtypes import describe_device  # noqa: E402
from lightning_opkit.precision.fp8 import Float8Linears, torchao_problem  # noqa: E402


def mlp(width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(device)


def step_seconds(model: nn.Module, x: torch.Tensor, autocast: bool, calls: int) -> float:
    """Median of ``calls`` forward + backward steps (after one warm-up step)."""
    times = []
    for i in range(calls + 1):
        sync(x.device)
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()
        sync(x.device)
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    problem = torchao_problem()
    if problem is not None:
        raise SystemExit(f"fp8 needs torchao: {problem}")
    device = torch.device(args.device)
    x = torch.randn(args.tokens, args.width, device=device)
    models = {"fp32": mlp(args.width, args.device), "bf16 (autocast)": mlp(args.width, args.device),
              f"fp8 ({args.recipe})": mlp(args.width, args.device)}
    fp8 = Float8Linears(args.recipe, census=lambda: None)
    fp8.convert(list(models[f"fp8 ({args.recipe})"].named_children()), device)
    if fp8.skipped:
        raise SystemExit(f"fp8 could not take the MLP's Linears: {fp8.skipped}")
    samples: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            samples[name].append(step_seconds(models[name], x, name.startswith("bf16"), args.calls))
    fp8.restore()
    medians = {name: statistics.median(v) for name, v in samples.items()}
    print(f"MLP {args.width} -> {4 * args.width} -> {args.width}, {args.tokens} tokens, forward + backward;"
          f" {describe_device(device)}; torch {torch.__version__}")
    for name, seconds in medians.items():
        print(f"  {name:<22} {1e3 * seconds:9.2f} ms/step   time ratio vs fp32: {seconds / medians['fp32']:.3f}")
    fp8_name = f"fp8 ({args.recipe})"
    print(f"fp8 / bf16: {medians[fp8_name] / medians['bf16 (autocast)']:.3f} (above 1: fp8 slower)")


if __name__ == "__main__":
    main()
