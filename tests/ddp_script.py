"""Run by test_ddp.py: 2-process CPU DDP (gloo) with ProfilerWindows and TorchCompile; each rank writes a JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from compile.test_torch_compile import Blocks  # noqa: E402
from helpers import make_loader  # noqa: E402

from lightning_opkit import ProfilerWindows, TorchCompile  # noqa: E402
from lightning_opkit.profiler.roofline.levers import lever  # noqa: E402

if __name__ == "__main__":
    out, all_ranks = sys.argv[1], sys.argv[2] == "all"
    if sys.argv[2] == "compile-off":  # the off switch, read by every rank (the launched ranks inherit it)
        os.environ["OPKIT_DISABLE"] = "compile"
    profiler = ProfilerWindows(every_n_steps=2, warmup=0, active=1, all_ranks=all_ranks, roofline=True)
    compiler = TorchCompile(modules=["blocks.*"], backend="eager")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, callbacks=[profiler, compiler],
                         logger=pl.loggers.TensorBoardLogger(out), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    model = Blocks(depth=2)
    trainer.fit(model, make_loader(n=96))
    trainer.save_checkpoint(os.path.join(out, "ddp.ckpt"))
    result = {
        "trace_files": [os.path.basename(p) for p in profiler.trace_files],
        "windows": profiler.windows_done,
        "frames": compiler.watch.frames,
        "compiler_enabled": compiler.enabled,
        "compiled": compiler.compiled,
        "weights": [round(float(v), 6) for v in model.head.weight.detach().flatten()[:6]],
        "compiled_after": ["forward" in vars(m) for m in model.blocks.modules()],
        "keys": list(torch.load(os.path.join(out, "ddp.ckpt"), weights_only=False)["state_dict"]),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    roofline = profiler.last_roofline
    if roofline is not None:
        comm = roofline.rows.get("communication")
        result.update(link_gbps=roofline.peaks.link_gbps, comm_bytes_per_step=comm and comm.bytes / roofline.steps,
                      comm_gbps=comm and comm.gbps, comm_lever=comm and lever(comm, roofline))
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
