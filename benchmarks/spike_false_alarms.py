"""How often NaNDetector's spike detection alarms on healthy runs: every zoo model, long runs, no fault injected.

Each zoo model (torch's own modules and tiny Hugging Face models) trains on its own data (random tokens or images,
16 batches an epoch, memorized over the epochs) under a constant learning rate with ``spike_zscore`` on. Prints per
model the steps judged, the alarms (every one a false alarm: nothing was injected), and the highest loss and
gradient-norm scores a good step had: how far below the threshold a healthy run stays.

    python benchmarks/spike_false_alarms.py --steps 1000 --zscore 6
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from zoo import CASES, ZooModule  # noqa: E402

from lightning_opkit import NaNDetector  # noqa: E402


class Steady(ZooModule):
    """A zoo model under a constant learning rate."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def run(name: str, steps: int, zscore: float, lr: float) -> dict:
    torch.manual_seed(0)
    model = Steady(CASES[name], lr=lr)
    detector = NaNDetector(action="warn", spike_zscore=zscore)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, callbacks=[detector],
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root)
        trainer.fit(model, model.loader(n=64))
    spikes = detector.state_dict()["spikes"]
    alarms = [e for e in detector.events if e["kind"] == "spike"]
    return {"judged": spikes["judged"] + len(alarms), "alarms": len(alarms), "loss_z": spikes["highest"][0],
            "grad_z": spikes["highest"][1], "at": [(e["step"], e["phase"], round(e["zscore"], 1)) for e in alarms]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--zscore", type=float, default=6.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--models", nargs="*", default=sorted(CASES))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    print(f"spike_zscore={args.zscore:g}, {args.steps} steps per model, AdamW lr={args.lr:g} (constant)")
    print(f"  {'model':14s} {'judged':>7s} {'alarms':>7s} {'max loss z':>11s} {'max grad z':>11s}")
    judged = alarms = 0
    for name in args.models:
        r = run(name, args.steps, args.zscore, args.lr)
        judged, alarms = judged + r["judged"], alarms + r["alarms"]
        print(f"  {name:14s} {r['judged']:7d} {r['alarms']:7d} {r['loss_z']:11.2f} {r['grad_z']:11.2f}"
              + (f"   alarms at {r['at']}" if r["at"] else ""), flush=True)
    print(f"false-alarm rate: {alarms} in {judged} judged steps ({alarms / max(judged, 1):.2%})")


if __name__ == "__main__":
    main()
