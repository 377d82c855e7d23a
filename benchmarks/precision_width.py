"""PrecisionPolicy at realistic widths, side by side with plain fp32 and plain bf16-mixed, eager and compiled.

Two models where GEMMs dominate the step, so that a 16-bit dtype can pay off where the hardware has 16-bit units:

- ``lm``: a GPT-2-style LM (Hugging Face ``GPT2LMHeadModel``, random init, d_model 512, 4 layers, 8 heads,
  seq 256, batch 8, vocab 8192, AdamW), on random tokens;
- ``vit``: the example ViT widened (dim 512, depth 4, MLP ratio 4, batch 256) on the digits.

Variants, interleaved in one process (A B C D A' A B C D A' ...), median ms/step over the steps after ``--skip``
(10: warm-up, compilation, and auto's trial steps, which train while they time each contender):
plain ``bf16-mixed`` (twice: the A/A control), plain ``32-true``, ``PrecisionPolicy(rules="auto")`` and
``PrecisionPolicy()`` (the built-in table), each eager and under ``TorchCompile(modules="auto")`` (Inductor).
For auto it prints what it chose, what choosing cost, and the chosen table's error beside bf16-mixed's.

    python benchmarks/precision_width.py [--model lm|vit|all] [--compile eager|compiled|all] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_opkit import PrecisionPolicy, TorchCompile  # noqa: E402
from lightning_opkit.precision.dtypes import describe_device  # noqa: E402

ACCELERATOR = "cpu"


class LM(pl.LightningModule):
    """A GPT-2-style causal LM from a random-init config (nothing downloaded)."""

    def __init__(self, width: int = 512, layers: int = 4, heads: int = 8, seq: int = 256, vocab: int = 8192) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=seq,
                                                vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def lm_loader(steps: int, batch: int = 8, seq: int = 256, vocab: int = 8192) -> DataLoader:
    tokens = torch.randint(0, vocab, (batch * steps, seq), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch)


def vit_model() -> pl.LightningModule:
    from examples.vit import ViTClassifier

    torch.manual_seed(0)
    return ViTClassifier(dim=512, depth=4, heads=8, mlp_ratio=4)


def vit_loader(steps: int, batch: int = 256) -> DataLoader:
    from examples.vit import load_digits_tensors

    images, labels = load_digits_tensors()
    return DataLoader(TensorDataset(images, labels), batch_size=batch, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


MODELS = {"lm": (LM, lm_loader, "GPT-2-style LM, d_model 512, 4 layers, seq 256, batch 8, vocab 8192"),
          "vit": (vit_model, vit_loader, "example ViT widened: dim 512, depth 4, MLP ratio 4, batch 256")}


class StepTimer(pl.Callback):
    """Wall time between consecutive training batch starts (CUDA synchronized)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if ACCELERATOR == "cuda":
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if ACCELERATOR == "cuda":
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


def run(model_name: str, variant: str, compiled: bool, steps: int, skip: int) -> tuple[float, PrecisionPolicy | None]:
    make_model, make_loader, _ = MODELS[model_name]
    policy = None
    callbacks: list[pl.Callback] = []
    precision = "32-true"
    if variant == "bf16-mixed":
        precision = "bf16-mixed"
    elif variant == "auto":
        policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    elif variant == "built-in":
        policy = PrecisionPolicy(census_every_n_steps=0, measure=False)
    if policy is not None:
        callbacks.append(policy)
    if compiled:
        callbacks.append(TorchCompile(modules="auto"))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(default_root_dir=root, max_steps=steps, accelerator=ACCELERATOR, devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[timer, *callbacks], limit_val_batches=0, num_sanity_val_steps=0,
                             precision=precision)
        trainer.fit(make_model(), make_loader(steps))
    intervals = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    return statistics.median(intervals[skip:]), policy


VARIANTS = {"bf16-mixed": "precision='bf16-mixed'", "fp32": "precision='32-true'",
            "auto": "PrecisionPolicy(rules='auto')", "built-in": "PrecisionPolicy() (built-in table)",
            "bf16-mixed (A/A)": "precision='bf16-mixed' again (A/A control)"}


def suite(model_name: str, compiled: bool, args) -> None:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    policies: list[PrecisionPolicy] = []
    skip = args.skip  # warm-up, compilation and auto's trial steps: every variant is timed on the same steps
    for _ in range(args.reps):
        for variant in VARIANTS:
            seconds, policy = run(model_name, variant.split(" ")[0], compiled, args.steps, skip)
            times[variant].append(seconds)
            if policy is not None and policy.auto:
                policies.append(policy)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    title = MODELS[model_name][2]
    mode = "TorchCompile(modules='auto'), inductor" if compiled else "eager"
    print(f"\n== {title}; {mode}; {args.steps} steps x {args.reps} reps, median ms/step after {skip} steps")
    for variant, label in VARIANTS.items():
        print(f"  {label:<46} {1e3 * med[variant]:9.1f} ms/step   vs fp32 {med[variant] / med['fp32']:.3f}"
              f"   vs bf16-mixed {med[variant] / med['bf16-mixed']:.3f}")
    best = min(("fp32", "bf16-mixed"), key=med.__getitem__)
    print(f"  auto / faster of fp32 and bf16-mixed ({best}): {med['auto'] / med[best]:.3f} (target <= 1.02);"
          f" A/A {med['bf16-mixed (A/A)'] / med['bf16-mixed']:.3f}")
    last = policies[-1]
    seconds = [p.measure_seconds for p in policies if p.measurements]
    print(f"  auto measured in {statistics.median(seconds):.2f} s (median of {len(seconds)}) on"
          f" {last.measurements.device}")
    if last.choice is not None:
        print(f"  {last.choice.comparison()}")  # with the trial steps' times, where they ran
        print("\n" + last.choice.table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--compile", choices=["eager", "compiled", "all"], default="all")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip", type=int, default=10,
                        help="steps left out of each median: warm-up, and auto's trial steps (up to 8)")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    print(f"torch {torch.__version__}, lightning {pl.__version__}; {describe_device(args.accelerator)}")
    for model_name in MODELS if args.model == "all" else [args.model]:
        for compiled in (False, True):
            if args.compile in ("all", "compiled" if compiled else "eager"):
                suite(model_name, compiled, args)


if __name__ == "__main__":
    main()
