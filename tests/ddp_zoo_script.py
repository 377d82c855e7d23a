"""Run by test_ddp.py: 2-process CPU DDP (gloo), all four callbacks on a zoo model, a NaN on rank 1 only."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from helpers import SkewedAuto  # noqa: E402
from zoo import ZooModule  # noqa: E402

from lightning_opkit import (  # noqa: E402
    ActivationCheckpointing,
    NaNDetector,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
)
from lightning_opkit.precision import decide  # noqa: E402


class RankFault(ZooModule):
    def _hit(self, kind):
        return self.global_rank == 1 and super()._hit(kind)


if __name__ == "__main__":
    out, regional, auto = sys.argv[1], sys.argv[2] in ("regional", "auto"), sys.argv[2] == "auto"
    torch.manual_seed(0)
    model = RankFault("torch_encoder", faults={"forward": 2})
    detector = NaNDetector(action="skip")
    compiler = TorchCompile(modules=["model.encoder.layers.*"] if regional else None, backend="eager")
    if auto:
        policy = SkewedAuto(rules="auto", overrides={"model.head": "fp32"}, census_every_n_steps=2)
    else:
        policy = PrecisionPolicy(overrides={"model.head": "fp32"}, census_every_n_steps=2)
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1)
    # regional: the compiled blocks also checkpointed (both wrap each block's forward)
    extra = [ActivationCheckpointing(modules=["model.encoder.layers.*"], measure=False)] if regional and not auto \
        else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5,
                         callbacks=[policy, detector, windows, compiler, *extra],
                         logger=pl.loggers.TensorBoardLogger(out),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(model, model.loader(n=64))
    result = {
        "events": [[e["step"], e["phase"], e["module"], e["rank"]] for e in detector.events],
        "skipped": detector.skipped_steps,
        "weights": [round(float(v), 6) for v in model.model.head.weight.detach().flatten()[:8]],
        "global_step": trainer.global_step,
        "frames": compiler.watch.frames,
        "graphs": compiler.watch.graphs,
        "checkpointed": extra[0].checkpointed if extra else None,
        # the root is left out: Lightning's DDP forward redirection restores it as an instance attribute
        "forward_patched": [n for n, m in model.named_modules() if n and "forward" in vars(m)],
        "graph_breaks": sum(compiler.watch.graph_breaks().values()),
        "graph_break_reasons": compiler.watch.graph_breaks(),
        "error": compiler.error,
        "census": sorted(f"{c}:{d}" for c, d in policy.census),
        "windows": windows.windows_done,
        "table": policy.table,
        "own": {c: d.dtype for c, d in decide(policy.measurements).items()} if auto else None,
        "chosen": policy.choice.best.table if auto and policy.choice else None,
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
