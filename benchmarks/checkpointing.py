"""Activation checkpointing's trade-off: bytes autograd holds for backward against step time, side by side.

For a GPT-2-style LM (Hugging Face GPT-2, 4 layers, d_model 128, 8 x 256 tokens) and a ResNet-style CNN (4 basic
blocks of 32 channels, 64 x 32 x 32 images), four ways: no checkpointing, every block (full), every block keeping
its GEMMs' outputs (selective: ``save=["matmul", "attention"]`` as torchtitan for the LM, ``["conv"]`` for the
CNN), and every other block. Bytes are counted by ``SavedBytes`` (what autograd saves, each storage once, plus
what a selective checkpoint caches); step time is a forward and backward, the variants interleaved in one process
(A B C D A B C D ...), medians and ratios to none.

    python benchmarks/checkpointing.py --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_opkit.checkpointing.region import CheckpointedForward  # noqa: E402
from lightning_opkit.core.saved import SavedBytes  # noqa: E402


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=1024, n_positions=256,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 1024, (8, 256), generator=torch.Generator().manual_seed(0))

    def loss():
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return model, list(model.transformer.h), loss


def cnn():
    from torch import nn
    from zoo import BasicBlock

    torch.manual_seed(0)
    blocks = [BasicBlock(32) for _ in range(4)]
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
                          *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(0))
    return model, blocks, lambda: F.cross_entropy(model(x), y)


VARIANTS = {"none": None, "full": (), "selective (GEMMs kept)": "selective", "every other block (full)": "half"}
#: what the selective variant keeps: a transformer's GEMMs and attention (torchtitan's choice), a CNN's convolutions
KEEP = {"gpt2": ("matmul", "attention"), "cnn": ("conv",)}


def apply(blocks, variant, keep):
    """Checkpoint ``blocks`` as ``variant`` says; returns an undo."""
    spec = VARIANTS[variant]
    chosen = [] if spec is None else (blocks[::2] if spec == "half" else blocks)
    save = keep if spec == "selective" else ()
    for block in chosen:
        block.forward = CheckpointedForward(block, block.forward, save)
        block.forward.note_kept = None

    def undo():
        for block in chosen:
            del block.forward

    return chosen, undo


def measure(make, reps: int, keep: tuple[str, ...]) -> None:
    model, blocks, loss = make()
    results = {v: {"bytes": 0, "times": []} for v in VARIANTS}
    for rep in range(reps + 1):  # the first round warms up
        for variant in VARIANTS:
            chosen, undo = apply(blocks, variant, keep)
            saved = SavedBytes(model)
            for block in chosen:
                block.forward.note_kept = saved.note
            with saved.counting():
                value = loss()
            for block in chosen:
                block.forward.note_kept = None
            value.backward()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss().backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            undo()
            results[variant]["bytes"] = saved.activations
            if rep:
                results[variant]["times"].append(elapsed)
    base = results["none"]
    base_t = statistics.median(base["times"])
    for variant, r in results.items():
        t = statistics.median(r["times"])
        print(f"  {variant:31s} {r['bytes'] / 2**20:8.1f} MB saved ({r['bytes'] / base['bytes']:.3f})"
              f"   {1e3 * t:8.1f} ms/step ({t / base_t:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=["gpt2", "cnn"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios to no checkpointing")
    for name in args.models:
        print(f"{name} (selective keeps {', '.join(KEEP[name])}):")
        measure({"gpt2": gpt2, "cnn": cnn}[name], args.reps, KEEP[name])


if __name__ == "__main__":
    main()
