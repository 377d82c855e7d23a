"""Host cost per op: what autocast and PrecisionPolicy's mode add over plain fp32 on tiny tensors.

On tiny tensors the compute is ~0, so the time is the host's: the regime of a GPU in eager mode, where the host
issues kernels and a step is often host-bound. A stack of 50 blocks of Linear -> LayerNorm -> GELU -> softmax
(200 governed ops per forward) on a (4, 8) input runs forward + backward; variants interleave in one process and the
median of many repetitions is kept. Rows:

- ``autocast``: ``torch.autocast(dtype=bfloat16)``, Lightning's ``bf16-mixed``.
- ``empty TorchFunctionMode``: a mode that only passes each call through: the floor of any Python-level mode.
- ``PrecisionPolicy mode``: the built-in table (matmul, activation in bf16; norm, softmax in fp32), so it casts
  more than autocast does (autocast leaves layer_norm and softmax in their input's dtype on CPU).
- ``PrecisionPolicy mode, autocast-like table``: matmul in bf16, the rest ``keep``: the same casts as autocast.

    python benchmarks/host_cost.py [--accelerator cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from lightning_opkit.precision.dtypes import GOVERNED, NEVER_CAST  # noqa: E402
from lightning_opkit.precision.function_mode import ModeState, PolicyMode  # noqa: E402
from lightning_opkit.precision.policy import DEFAULT_RULES  # noqa: E402

BLOCKS = 50
OPS_PER_BLOCK = 4


class Block(nn.Module):
    """Linear -> LayerNorm -> GELU -> softmax: four governed ops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(F.gelu(self.ln(self.fc(x))), -1)


class PassThrough(TorchFunctionMode):
    """A mode that only passes each call on: the cost of any Python-level mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def policy_mode(table: dict[str, str], device: str) -> PolicyMode:
    state = ModeState(table | dict.fromkeys(NEVER_CAST, "keep"))
    state.autocast_devices = []
    return PolicyMode(state)


def interleaved(variants: dict, step, reps: int) -> dict[str, list[float]]:
    """Warm every variant up, then time them round robin, ``reps`` times each."""
    for make in variants.values():
        for _ in range(5):
            step(make)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, make in variants.items():
            times[name].append(step(make))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    device = args.accelerator
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(8) for _ in range(BLOCKS)]).to(device)
    x = torch.randn(4, 8, device=device)
    builtin = {c: DEFAULT_RULES.get(c, "keep") for c in GOVERNED}
    like_autocast = dict.fromkeys(GOVERNED, "keep") | {"matmul": "bf16"}
    variants = {
        "fp32": contextlib.nullcontext,
        "autocast (bf16-mixed)": lambda: torch.autocast(device, dtype=torch.bfloat16),
        "empty TorchFunctionMode": PassThrough,
        "PrecisionPolicy mode, built-in table": lambda: policy_mode(builtin, device),
        "PrecisionPolicy mode, autocast-like table": lambda: policy_mode(like_autocast, device),
    }

    def step(make) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with make():
            out = net(x)
        out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = interleaved(variants, step, args.reps)
    ops = BLOCKS * OPS_PER_BLOCK
    per_op = {name: statistics.median(ts) / ops * 1e6 for name, ts in times.items()}
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; {ops} governed ops per forward,"
          f" forward + backward, median of {args.reps}")
    added = {name: us - per_op["fp32"] for name, us in per_op.items()}
    for name, us in per_op.items():
        line = f"  {name:<44} {us:7.2f} us/op"
        if name != "fp32":
            line += f"   adds {added[name]:6.2f} us/op"
            if name != "autocast (bf16-mixed)":
                line += f" = {added[name] / added['autocast (bf16-mixed)']:.2f}x autocast's"
        print(line)


if __name__ == "__main__":
    main()
