"""Run by nan/test_spike_report.py: 2 CPU processes (gloo), DDP or FSDP2; one step, rank 1 gets random tokens."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from nan.test_spike_report import FAULT_STEP, Losses, Steady, _loader, _pattern  # noqa: E402
from zoo import CASES, SEQ, VOCAB  # noqa: E402

from lightning_opkit import NaNDetector  # noqa: E402


def _full(tensor):
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class PerRank(Steady):
    """Each rank its own stream of batches (no distributed sampler); rank 1's has the corrupted one."""

    def train_dataloader(self):
        clean = _pattern(FAULT_STEP + 6, seed=self.global_rank)
        if self.global_rank == 1:
            clean[FAULT_STEP] = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
        return _loader(clean)


class ShardedPerRank(PerRank):
    """The same under FSDP2: each encoder layer and the root fully_shard'ed (ModelParallelStrategy)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        from lightning_opkit import find_blocks

        mesh = self.device_mesh["data_parallel"]
        for name in find_blocks(self):
            fully_shard(self.get_submodule(name), mesh=mesh)
        fully_shard(self, mesh=mesh)


if __name__ == "__main__":
    out, fsdp2 = sys.argv[1], sys.argv[2] == "fsdp2"
    detector, losses = NaNDetector(action="skip", spike_zscore=6.0), Losses()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=FAULT_STEP + 6, logger=False,
                         callbacks=[detector, losses], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out, use_distributed_sampler=False)
    torch.manual_seed(0)
    model = (ShardedPerRank if fsdp2 else PerRank)(CASES["torch_encoder"])
    trainer.fit(model)
    result = {
        "events": [{k: e[k] for k in ("step", "kind", "rank", "batch_idx", "module", "cause", "advice", "zscore",
                                      "top_parameters")} for e in detector.events],
        "skipped": detector.skipped_steps,
        "losses": losses.losses,
        # the full weights (FSDP2: every rank's shards gathered), to compare the ranks' models
        "weights": [float(v) for v in _full(model.model.head.weight).flatten()[:16]],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
