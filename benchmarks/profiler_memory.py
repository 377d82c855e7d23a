"""Memory over a long run with ProfilerWindows: resident memory after each window, and its growth per window.

Trains a small MLP for ``--steps`` steps with a window every ``--every`` steps, with automatic garbage collection
left as it is, and prints the process's resident memory (RSS) after every window. Before profiles were emptied at
window close, finished ``torch.profiler.profile`` objects sat in reference cycles with their events until a full
collection: about 2 MB per window.

    python benchmarks/profiler_memory.py --steps 2000 --every 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_opkit import ProfilerWindows  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class MLP(pl.LightningModule):
    """A small MLP: the profiled work is small, so what the profiler keeps stands out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class RSSAfterWindows(pl.Callback):
    """Resident memory right after each window closes."""

    def __init__(self, windows: ProfilerWindows) -> None:
        self.windows = windows
        self.seen = 0
        self.rss: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.windows.windows_done != self.seen:
            self.seen = self.windows.windows_done
            self.rss.append(rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,))), batch_size=16)
    windows = ProfilerWindows(every_n_steps=args.every, warmup=1, active=3, export_trace=False)
    probe = RSSAfterWindows(windows)
    trainer = pl.Trainer(max_steps=args.steps, max_epochs=-1, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tempfile.mkdtemp(), callbacks=[windows, probe])
    trainer.fit(MLP(), data)
    rss = probe.rss
    half = len(rss) // 2
    # The first windows pay one-off costs (profiler start-up, allocator growth); the trend is in the second half.
    growth = (rss[-1] - rss[half]) / max(1, len(rss) - 1 - half)
    print(f"windows: {len(rss)}; RSS after each (MB): {', '.join(f'{v:.0f}' for v in rss)}")
    print(f"RSS after the first window: {rss[0]:.1f} MB, after the last: {rss[-1]:.1f} MB;"
          f" median {statistics.median(rss):.1f} MB")
    print(f"growth per window over the second half: {growth:.3f} MB/window")


if __name__ == "__main__":
    main()
