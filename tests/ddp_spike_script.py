"""Run by test_spikes.py: 2-process CPU DDP (gloo); only rank 1's batch at one step is random tokens (a spike)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from test_spikes import FAULT_STEP, Losses, Steady, _loader, _pattern  # noqa: E402
from zoo import CASES, SEQ, VOCAB  # noqa: E402

from lightning_opkit import NaNDetector  # noqa: E402


class PerRank(Steady):
    """Each rank its own stream of batches (no distributed sampler); rank 1's has the corrupted one."""

    def train_dataloader(self):
        clean = _pattern(FAULT_STEP + 6, seed=self.global_rank)
        if self.global_rank == 1:
            clean[FAULT_STEP] = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
        return _loader(clean)


if __name__ == "__main__":
    out = sys.argv[1]
    detector, losses = NaNDetector(action="skip", spike_zscore=6.0), Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=FAULT_STEP + 6, logger=False,
                         callbacks=[detector, losses], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out, use_distributed_sampler=False)
    torch.manual_seed(0)
    model = PerRank(CASES["torch_encoder"])
    trainer.fit(model)
    result = {
        "events": [{k: e[k] for k in ("step", "kind", "rank", "batch_idx", "module", "cause", "advice", "zscore",
                                      "top_parameters")} for e in detector.events],
        "skipped": detector.skipped_steps,
        "losses": losses.losses,
        "weights": [float(v) for v in model.model.head.weight.detach().flatten()[:16]],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
