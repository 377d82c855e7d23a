"""PrecisionPolicy where the host issues the step: the zoo's GPT-2 and Llama at small width, 1 thread, eager.

At d_model 64-128 a step's kernels take about as long as Python takes to issue them: the regime of an eager GPU step
on the models most people train, where the policy's per-op host cost decides whether it beats ``bf16-mixed``. Each
model trains, interleaved in one process (A B C ... A' per round), as:

- ``fp32``: ``precision="32-true"``, no callback; ``bf16-mixed``: plain autocast, no callback (run twice a round:
  the A/A control);
- ``auto``: ``PrecisionPolicy(rules="auto")`` under ``32-true``;
- ``built-in table``: ``PrecisionPolicy()`` under ``32-true`` (norm and softmax raised to fp32: the mode runs);
- ``autocast table``: ``PrecisionPolicy`` with GEMM classes in bf16 and every other class ``keep`` under ``32-true``
  (what autocast does: it runs as autocast).

Every policy runs with ``census_every_n_steps=0`` (census steps are priced by ``overhead.py --suite kit``). Step time
is the median interval between batch starts after ``--skip`` steps (auto's trial steps fall inside them); ratios are
paired per round, then the median over rounds is printed.

    python benchmarks/launch_bound.py [--widths 64 128] [--reps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from overhead import StepTimer  # noqa: E402
from zoo import CASES, ZooModule  # noqa: E402

from lightning_opkit import PrecisionPolicy  # noqa: E402
from lightning_opkit.opclass import GOVERNED  # noqa: E402
from lightning_opkit.precision.governor import AUTOCAST_LOWERS  # noqa: E402

AUTOCAST_TABLE = dict.fromkeys(GOVERNED, "keep") | dict.fromkeys(AUTOCAST_LOWERS, "bf16")


def zoo_model(name: str, width: int) -> ZooModule:
    """The zoo's ``hf_gpt2`` or ``hf_llama`` at ``width`` (4 layers, seq 64, vocab 512), seeded."""
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        build = lambda: GPT2LMHeadModel(GPT2Config(  # noqa: E731
            n_embd=width, n_layer=4, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        build = lambda: LlamaForCausalLM(LlamaConfig(  # noqa: E731
            hidden_size=width, intermediate_size=4 * width, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, use_cache=False))
    torch.manual_seed(0)
    return ZooModule(dataclasses.replace(CASES[name], build=build))


VARIANTS = {
    "fp32": lambda: ([], "32-true"),
    "bf16-mixed": lambda: ([], "bf16-mixed"),
    "auto": lambda: ([PrecisionPolicy(rules="auto", census_every_n_steps=0)], "32-true"),
    "built-in table": lambda: ([PrecisionPolicy(census_every_n_steps=0, measure=False)], "32-true"),
    "autocast table": lambda: ([PrecisionPolicy(rules=AUTOCAST_TABLE, census_every_n_steps=0, measure=False)],
                               "32-true"),
    "bf16-mixed (A/A control)": lambda: ([], "bf16-mixed"),
}


def step_time(name: str, width: int, make, steps: int, skip: int) -> tuple[float, list[pl.Callback]]:
    model = zoo_model(name, width)
    callbacks, precision = make()
    timer = StepTimer()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, *callbacks],
                         precision=precision, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, model.loader(n=4 * steps))
    return statistics.median(timer.intervals()[skip:]), callbacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["hf_gpt2", "hf_llama"])
    parser.add_argument("--widths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread; eager; median ms/step after {args.skip} steps, ratios paired"
          f" per round, median of {args.reps} rounds")
    for name in args.models:
        for width in args.widths:
            rounds: list[dict[str, float]] = []
            chosen = ""
            for _ in range(args.reps):
                times = {}
                for variant, make in VARIANTS.items():
                    times[variant], callbacks = step_time(name, width, make, args.steps, args.skip)
                    if variant == "auto":
                        policy = callbacks[0]
                        chosen = ", ".join(f"{c} {d.dtype}" for c, d in policy.decisions.items())
                        if policy._governor.autocast:
                            chosen = f"plain autocast in {policy._governor.autocast}"
                rounds.append(times)
            print(f"\n== {name}, d_model {width}")
            for variant in VARIANTS:
                ms = 1e3 * statistics.median(r[variant] for r in rounds)
                vs_bf16 = statistics.median(r[variant] / r["bf16-mixed"] for r in rounds)
                vs_fp32 = statistics.median(r[variant] / r["fp32"] for r in rounds)
                print(f"  {variant:<26} {ms:8.2f} ms/step   {vs_bf16:5.3f}x bf16-mixed   {vs_fp32:5.3f}x fp32")
            best = statistics.median(r["auto"] / min(r["fp32"], r["bf16-mixed"]) for r in rounds)
            print(f"  auto / the faster of fp32 and bf16-mixed, per round: {best:.3f} (target <= 1.05); auto chose:"
                  f" {chosen}")


if __name__ == "__main__":
    main()
