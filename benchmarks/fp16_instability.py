"""A real fp16 instability trained four ways: fp32, bf16-mixed, 16-mixed, 16-mixed with opkit's repair.

Each with its GradScaler where fp16 runs. Prints steps lost, the final loss against fp32's, and where the repair
pinned.

Two overflows a user meets, on tiny Hugging Face models learning a repeating token pattern:

- ``t5``: a T5 whose feed-forward output passes 65504 (the documented T5 fp16 failure; here two FFN ``wo`` weights are
  scaled up as a proxy for trained ones). Loss scaling cannot help: the overflow is in the forward.
- ``attention``: a GPT-2 (eager attention) whose query and key projections have grown as at a high learning rate:
  its attention logits pass 65504, the softmax makes NaN.

    python benchmarks/fp16_instability.py --steps 60

fp16 autocast on a CPU is as slow as it is here; the figures are about steps and losses, not time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_opkit import NaNDetector  # noqa: E402

VOCAB, SEQ, DIM = 64, 16, 32


class LM(pl.LightningModule):
    """A tiny Hugging Face model on a repeating token pattern; its overflow made as ``fault`` says."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fault = fault
        if fault == "t5":
            from transformers import T5Config, T5ForConditionalGeneration

            self.net = T5ForConditionalGeneration(T5Config(
                vocab_size=VOCAB, d_model=DIM, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
            with torch.no_grad():  # two FFN output weights grown large, as trained T5 checkpoints have them
                self.net.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(30000.0)
                self.net.decoder.block[1].layer[2].DenseReluDense.wo.weight.mul_(30000.0)
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            self.net = GPT2LMHeadModel(GPT2Config(n_embd=DIM, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                                  bos_token_id=0, eos_token_id=0,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
            self.net.set_attn_implementation("eager")
            with torch.no_grad():  # queries and keys grown as at a high learning rate: logits ~ scale^2
                self.net.transformer.h[0].attn.c_attn.weight[:, : 2 * DIM].mul_(4000.0)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if self.fault == "t5":
            logits = self.net(input_ids=ids, labels=ids).logits
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1))
        logits = self.net(input_ids=ids).logits.float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def pattern(steps: int, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(SEQ) % 8
    ids = (base + torch.randint(0, 8, (steps * batch, 1), generator=g)) % VOCAB
    return DataLoader(TensorDataset(ids), batch_size=batch)


class Record(pl.Callback):
    """Every batch's loss, as a Python float (a sync per step: this is a benchmark of losses, not time)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def run(fault: str, how: str, steps: int) -> dict:
    record = Record()
    callbacks: list[pl.Callback] = [record]
    kwargs: dict = dict(precision="32-true")
    detector = None
    if how == "bf16-mixed":
        kwargs = dict(precision="bf16-mixed")
    elif how.startswith("16-mixed"):
        kwargs = dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    if how == "16-mixed + repair":
        detector = NaNDetector(action="skip")
        callbacks.append(detector)
    model = LM(fault)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(default_root_dir=root, accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)
        trainer.fit(model, pattern(steps))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    finite = [x for x in record.losses if math.isfinite(x)]
    return {"lost": sum(not math.isfinite(x) for x in record.losses), "final": finite[-1] if finite else math.nan,
            "last5": sum(finite[-5:]) / len(finite[-5:]) if finite else math.nan,
            "scale": scaler.get_scale() if scaler else None,
            "pinned": ", ".join(detector.state_dict()["repairs"]) if detector else "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault", choices=["t5", "attention", "both"], default="both")
    args = parser.parse_args()
    for fault in (["t5", "attention"] if args.fault == "both" else [args.fault]):
        rows = {how: run(fault, how, args.steps) for how in ("fp32", "bf16-mixed", "16-mixed", "16-mixed + repair")}
        ref = rows["fp32"]["last5"]
        print(f"\n{fault}: {args.steps} steps, torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(f"{'run':<20} {'steps lost':>10} {'mean of last 5 losses':>22} {'vs fp32':>8} {'scaler scale':>13}"
              "  pinned")
        for how, r in rows.items():
            ratio = r["last5"] / ref if math.isfinite(r["last5"]) and ref else math.nan
            scale = "-" if r["scale"] is None else f"{r['scale']:g}"
            print(f"{how:<20} {r['lost']:>10} {r['last5']:>22.4f} {ratio:>8.3f} {scale:>13}  {r['pinned']}")


if __name__ == "__main__":
    main()
