"""Print the sensitivity table (speed and error of each op class in 16-bit, measured here) and the decisions.

For the example ViT (batch 64 of the digits) and the zoo's Hugging Face GPT-2 (tiny random-init config, nothing
downloaded), on this machine's CPU (or ``--accelerator cuda``):

    python benchmarks/sensitivity.py
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from examples.vit import ViTClassifier, load_digits_tensors  # noqa: E402
from lightning_opkit.precision import decide, measure_precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tolerance", type=float, default=0.01)
    args = parser.parse_args()
    from zoo import CASES, ZooModule

    device = torch.device(args.accelerator)
    torch.manual_seed(0)
    images, labels = load_digits_tensors()
    gpt2 = ZooModule("hf_gpt2")
    models = {
        "example ViT (dim 64, depth 4, batch 64)": (ViTClassifier(), (images[:64], labels[:64])),
        "Hugging Face GPT-2, tiny config (zoo, batch 4 x 32 tokens)": (gpt2, next(iter(CASES["hf_gpt2"].data(16, 0)))),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for title, (model, batch) in models.items():
        model.to(device)
        table = measure_precision(model, lambda batch=batch: batch, device=device)
        chosen = {c: d.dtype for c, d in decide(table, args.tolerance, ["bf16", "fp16"]).items()}
        print(f"\n== {title}\n{table.table(chosen)}")
        print("decided: " + ", ".join(f"{c} {d}" for c, d in chosen.items()))


if __name__ == "__main__":
    main()
