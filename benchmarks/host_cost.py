"""Host cost per op: what autocast and PrecisionPolicy's mode add over plain fp32 on tiny tensors.

On tiny tensors the compute is ~0, so the time is the host's: the regime of a GPU in eager mode, where the host
issues kernels and a step is often host-bound. A stack of 50 blocks of Linear -> LayerNorm -> GELU -> softmax
(200 governed ops per forward) on a (4, 8) input runs forward + backward; variants interleave in one process and the
median of many repetitions is kept. Rows:

- ``autocast``: ``torch.autocast(dtype=bfloat16)``, Lightning's ``bf16-mixed``.
- ``empty TorchFunctionMode``: a mode that only passes each call through: the floor of any Python-level mode.
- ``PrecisionPolicy mode``: the built-in table (matmul, activation in bf16; norm, softmax in fp32), so it casts
  more than autocast does (autocast leaves layer_norm and softmax in their input's dtype on CPU).
- ``PrecisionPolicy mode, autocast-like table``: GEMM classes in bf16, the rest ``keep``: autocast's casts,
  forced through the mode (what the policy ran for such a table before issue 51).
- ``the built-in table's casts, written out``: the casts the built-in table asks for, written into the blocks by
  hand, no mode: the floor of any mechanism that runs that decision (its extra casts are kernels of their own).
- ``PrecisionPolicy step, ...``: the step as the policy runs it (its :class:`StepGovernor` wrapping the step): the
  autocast-like table runs as plain autocast, the built-in table under the mode.

Each row prints its step time over autocast's: the targets are 1.2x for an autocast-expressible table and 1.5x for
one autocast cannot express.

    python benchmarks/host_cost.py [--accelerator cuda] [--threads 1]
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
from lightning_opkit.precision.governor import StepGovernor  # noqa: E402
from lightning_opkit.precision.policy import DEFAULT_RULES  # noqa: E402

BLOCKS = 50
OPS_PER_BLOCK = 4


class Block(nn.Module):
    """Linear -> LayerNorm -> GELU -> softmax: four governed ops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)
        self.written_out = False  # the built-in table's casts, by hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.written_out:
            low = torch.bfloat16
            y = F.linear(x.to(low), self.fc.weight.to(low), self.fc.bias.to(low))
            y = F.layer_norm(y.float(), self.ln.normalized_shape, self.ln.weight, self.ln.bias, self.ln.eps)
            return F.softmax(F.gelu(y.to(low)).float(), -1)
        return F.softmax(F.gelu(self.ln(self.fc(x))), -1)


@contextlib.contextmanager
def written_out(net: nn.Module):
    for block in net:
        block.written_out = True
    try:
        yield
    finally:
        for block in net:
            block.written_out = False


class PassThrough(TorchFunctionMode):
    """A mode that only passes each call on: the cost of any Python-level mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def policy_mode(table: dict[str, str], device: str) -> PolicyMode:
    state = ModeState(table | dict.fromkeys(NEVER_CAST, "keep"))
    state.autocast_devices = []
    return PolicyMode(state)


def governed(table: dict[str, str], net: nn.Module) -> StepGovernor:
    """A governor as PrecisionPolicy sets one up for ``table`` on an fp32 model, no overrides."""
    governor = StepGovernor(table | dict.fromkeys(NEVER_CAST, "keep"))
    governor.express(table, net, overrides=False)
    return governor


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
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: as torch starts)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.accelerator
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(8) for _ in range(BLOCKS)]).to(device)
    x = torch.randn(4, 8, device=device)
    builtin = {c: DEFAULT_RULES.get(c, "keep") for c in GOVERNED}
    like_autocast = dict.fromkeys(GOVERNED, "keep") | dict.fromkeys(("matmul", "conv", "attention"), "bf16")
    variants = {
        "fp32": contextlib.nullcontext,
        "autocast (bf16-mixed)": lambda: torch.autocast(device, dtype=torch.bfloat16),
        "empty TorchFunctionMode": PassThrough,
        "PrecisionPolicy mode, built-in table": lambda: policy_mode(builtin, device),
        "PrecisionPolicy mode, autocast-like table": lambda: policy_mode(like_autocast, device),
        "the built-in table's casts, written out": lambda: written_out(net),
        "PrecisionPolicy step, autocast-like table": governed(like_autocast, net),
        "PrecisionPolicy step, built-in table": governed(builtin, net),
    }

    def forward() -> torch.Tensor:
        return net(x)

    def step(make) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if isinstance(make, StepGovernor):
            out = make.wrap(forward, is_training=True)()  # the training step; Lightning runs backward after it
        else:
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
    base = per_op["autocast (bf16-mixed)"]
    for name, us in per_op.items():
        line = f"  {name:<44} {us:7.2f} us/op   step {us / base:5.2f}x autocast's"
        if name != "fp32":
            line += f"   adds {added[name]:6.2f} us/op over fp32"
        print(line)


if __name__ == "__main__":
    main()
