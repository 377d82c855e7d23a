"""Run by nan/test_detector.py: 2-process CPU DDP (gloo) where only rank 1 produces a NaN at step 3.

Arguments: the output folder, the action, and optionally ``decide`` (``"device"``: a fused AdamW).
"""

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
from helpers import TinyNet, make_loader  # noqa: E402

from lightning_opkit import NaNDetector, NonFiniteError  # noqa: E402
from lightning_opkit.core.warn import OpkitWarning  # noqa: E402


class RankPoison(TinyNet):
    def forward(self, x):
        self.body[1].steps = {3} if self.global_rank == 1 else set()
        return super().forward(x)


if __name__ == "__main__":
    out, action = sys.argv[1], sys.argv[2]
    decide = sys.argv[3] if len(sys.argv) > 3 else "host"
    detector = NaNDetector(action=action, decide=decide)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False, callbacks=[detector],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    model = RankPoison(optimizer="fused_adamw" if decide == "device" else "sgd")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, make_loader(n=128))
        outcome = "finished"
    except NonFiniteError:
        outcome = "raised"
        caught = []
    result = {
        "outcome": outcome,
        "events": [[e["step"], e["phase"], e["module"], e["rank"]] for e in detector.events],
        "weights": [round(float(v), 6) for v in model.head.weight.detach().flatten()[:8]],
        "global_step": trainer.global_step,
        "warned": [str(w.message) for w in caught if issubclass(w.category, OpkitWarning)],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
