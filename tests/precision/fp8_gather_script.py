"""Run by test_fp8_gather.py: Float8AllGather on FSDP2 over 4 gloo processes, without a Trainer.

Two Linears (16x32, 32x16), each ``fully_shard``-ed, the first with ``reshard_after_forward=2`` (resharded after
forward to groups of two ranks, which needs 4). Each rank writes ``<out>/rank<r>.json``: what was gathered in float8,
what was left and why, the weight type each Linear was handed in two forward+backward steps, and after ``restore``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 4


class Dequantizing(nn.Linear):
    """A Linear that takes a float8-gathered weight back to fp32 (the policy's float8 GEMM is not under test here)."""

    def forward(self, x):
        from lightning_opkit.precision.fp8_gather import high_precision

        return F.linear(x, high_precision(self.weight), self.bias)


def run(rank, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_opkit.precision.fp8 import gemm_function
    from lightning_opkit.precision.fp8_gather import Float8AllGather, float8_weight

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        model = nn.Sequential(Dequantizing(16, 32), nn.GELU(), Dequantizing(32, 16))
        fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        gather = Float8AllGather()
        _, config, mm_config = gemm_function("tensorwise")
        gather.install(model, {"0": None, "2": None}, mm_config, config)
        handed = {}
        hooks = [model[i].register_forward_pre_hook(
            lambda module, args, i=i: handed.setdefault(str(i), set()).add(float8_weight(module.weight)))
            for i in (0, 2)]
        losses = []
        for _ in range(2):
            loss = model(torch.randn(4, 16)).square().mean()
            loss.backward()
            losses.append(loss.item())
        gather.restore()
        after = sorted({type(p.to_local()).__name__ for p in model.parameters()})
        for hook in hooks:
            hook.remove()
        result = {"gathered": gather.gathered, "live": gather.live, "skipped": gather.skipped, "after": after,
                  "handed": {k: sorted(v) for k, v in handed.items()}, "losses": losses,
                  "grads_finite": all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters())}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
