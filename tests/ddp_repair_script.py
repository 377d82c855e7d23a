"""Run by nan/test_repair.py: 2-process CPU DDP (gloo), fp16 autocast with a GradScaler, a fp16 forward overflow."""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from nan.test_repair import Losses, _overflowing  # noqa: E402

from lightning_opkit import NaNDetector  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    detector, losses = NaNDetector(action="skip"), Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False,
                         callbacks=[detector, losses], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out,
                         plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    model = _overflowing()
    trainer.fit(model, model.loader(n=80))
    result = {
        "events": [[e["step"], e["module"], e["cause"], e["repair"]] for e in detector.events],
        "repairs": detector.state_dict()["repairs"],
        "finite_after": [math.isfinite(loss) for _, loss in losses.losses[1:]],
        "weights": [round(float(v), 6) for v in model.model.lm_head.weight.detach().flatten()[:8]],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
