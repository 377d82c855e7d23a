"""What the roofline adds to ProfilerWindows: each window's cost with and without ``roofline=True``, in one process.

Variants, interleaved (A B A' A B A' ...): ``ProfilerWindows(every_n_steps, warmup=1, active=2)`` plain, with
``roofline=True``, and plain again (the A/A control), each logging to a real TensorBoard run, no trace export (its
gzip cost is the same either way). Per window it times the two parts that differ: the recorded steps (the roofline
turns on ``record_shapes`` and ``with_flops``) and the window's close (summaries, the roofline's pass over the
trace, its table and picture, the writes). The peaks are measured once per process before the runs (their cost is
printed apart), as a run pays them once, at its first window. Prints medians and ratios, and the last window's
roofline table; ``--save`` writes its picture.

    python benchmarks/roofline_cost.py [--model vit|lm|zoo_gpt2] [--reps 3] [--save docs/roofline_vit.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from precision_width import MODELS, StepTimer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_opkit import ProfilerWindows  # noqa: E402
from lightning_opkit.profiler.roofline.peaks import measure_peaks  # noqa: E402
from lightning_opkit.profiler.roofline.plot import roofline_figure  # noqa: E402
from lightning_opkit.profiler.roofline.view import roofline_table, summary_lines  # noqa: E402


def example_vit() -> pl.LightningModule:
    from examples.vit import ViTClassifier

    torch.manual_seed(0)
    return ViTClassifier()


def example_loader(steps: int) -> DataLoader:
    from examples.vit import load_digits_tensors

    images, labels = load_digits_tensors()
    return DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


def zoo_gpt2() -> pl.LightningModule:
    from zoo import build

    return build("hf_gpt2")


def zoo_loader(steps: int) -> DataLoader:
    return zoo_gpt2().loader(n=8 * steps)


CHOICES = {"vit": (example_vit, example_loader, "the example ViT (examples/vit.py defaults, batch 64)"),
           "lm": MODELS["lm"], "zoo_gpt2": (zoo_gpt2, zoo_loader, "the zoo's tiny random-init HF GPT-2")}


class TimedWindows(ProfilerWindows):
    """ProfilerWindows that times each window's close (report, roofline, logging)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.close_s: list[float] = []
        self.window_step_ms: list[float] = []

    def _close(self, trainer, partial):
        if self._window is None:
            return
        t0 = time.perf_counter()
        super()._close(trainer, partial)
        self.close_s.append(time.perf_counter() - t0)
        if self.last_report is not None:
            self.window_step_ms.append(self.last_report.step_time_ms)


def run(model: str, roofline: bool, steps: int, every: int) -> TimedWindows:
    make_model, make_loader, _ = CHOICES[model]
    windows = TimedWindows(every_n_steps=every, warmup=1, active=2, roofline=roofline, export_trace=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(default_root_dir=root, max_steps=steps, accelerator="cpu", devices=1,
                             logger=pl.loggers.TensorBoardLogger(root), enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[StepTimer(), windows], limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(make_model(), make_loader(steps))
    return windows


VARIANTS = {"windows": False, "windows + roofline": True, "windows (A/A)": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(CHOICES), default="vit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--save", default="", help="write the last window's roofline picture (PNG) here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    measure_peaks("cpu", ("fp32", "bf16"))
    print(f"peaks, measured once per process: {time.perf_counter() - t0:.2f} s")
    print(f"model: {CHOICES[args.model][2]}; {args.steps} steps, a window (1 warm-up + 2 recorded steps) every"
          f" {args.every}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    close: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    last = None
    for _ in range(args.reps):
        for name, roofline in VARIANTS.items():
            windows = run(args.model, roofline, args.steps, args.every)
            close[name] += windows.close_s
            step[name] += windows.window_step_ms
            last = windows if roofline else last
    base_close, base_step = statistics.median(close["windows"]), statistics.median(step["windows"])
    for name in VARIANTS:
        c, s = statistics.median(close[name]), statistics.median(step[name])
        extra = 1e3 * c + 2 * s  # a window's cost beyond plain steps: its close and its two recorded steps
        print(f"  {name:20s} close {1e3 * c:8.2f} ms/window (ratio {c / base_close:5.2f})   recorded step"
              f" {s:8.2f} ms (ratio {s / base_step:5.2f})   window {extra:8.2f} ms (ratio"
              f" {extra / (1e3 * base_close + 2 * base_step):5.2f})")
    extra_s = statistics.median(close["windows + roofline"]) - base_close + 2e-3 * (
        statistics.median(step["windows + roofline"]) - base_step)
    plain_step_s = 1e-3 * base_step
    print(f"  the roofline's extra cost per window: {1e3 * extra_s:.1f} ms; with the default every_n_steps=500 that"
          f" is {100 * extra_s / (500 * plain_step_s):.2f}% of training time (at {1e3 * plain_step_s:.1f} ms / step)")
    report = last.last_roofline
    print("\n" + roofline_table(report) + "\n\n" + "\n".join(summary_lines(report)))
    if args.save:
        title = f"{CHOICES[args.model][2]}: op classes against {report.peaks.device}'s measured roofs"
        roofline_figure(report.rows, report.peaks, title).savefig(args.save)
        print(f"wrote {args.save}")


if __name__ == "__main__":
    main()
