"""The model zoo: architectures nobody here wrote, each wrapped in one generic LightningModule.

torch's own ``nn.TransformerEncoder`` (causal ``-inf`` mask, ``batch_first``), ``nn.MultiheadAttention`` and
``nn.LSTM``, a BatchNorm ResNet-style CNN with ``ReLU(inplace=True)``, and Hugging Face GPT-2, Llama and BERT from
tiny random-init configs (nothing is downloaded). Each case names the paths the tests poke at: a deep submodule to
poison, a parameter, the repeated blocks to compile regionally, and GEMM / norm modules whose dtypes are checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, DIM = 64, 16, 32


@dataclass(frozen=True)
class Case:
    """One zoo model and the module paths (inside it) that the tests use."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int, int], DataLoader]  # (n, seed) -> loader
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    deep: str  # a deep GEMM/conv submodule to poison in forward and backward
    param: str  # a parameter whose gradient to poison
    blocks: str  # glob of the repeated blocks to compile regionally
    gemm: str  # a GEMM module (matmul class) inside a block
    norm: str  # a norm module inside a block
    override: str  # a GEMM module inside a block that a module override pins to fp32
    buffers: bool = False  # has floating buffers that training updates (BatchNorm)


def _tokens(n: int, seed: int, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(ids, labels), batch_size=batch_size)


def _images(n: int, seed: int, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g)),
                      batch_size=batch_size)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class TorchEncoderLM(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` with a causal ``-inf`` mask, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


class MHABlock(nn.Module):
    """Pre-norm block around ``nn.MultiheadAttention`` and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + F.gelu(self.fc(x))


class MHALM(nn.Module):
    """Embedding, two ``nn.MultiheadAttention`` blocks with a causal mask, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


class LSTMBlock(nn.Module):
    """``nn.LSTM`` with a norm and a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(DIM, DIM, batch_first=True)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lstm(x)[0])


class LSTMClassifier(nn.Module):
    """Embedding, two ``nn.LSTM`` blocks, a projection and a head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(LSTMBlock() for _ in range(2))
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(F.relu(self.proj(x[:, -1])))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU(inplace)-conv-BN, plus the identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ResNetish(nn.Module):
    """A torchvision-style ResNet in miniature (stem, two basic blocks, pool, fc)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=DIM, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0, use_cache=False))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=VOCAB,
                                                    max_position_embeddings=SEQ, num_labels=3,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _mixtral(experts: str = "grouped_mm") -> nn.Module:
    """A tiny Mixtral: 4 experts a layer in fused 3-D weights, a top-2 router; ``experts`` is Hugging Face's
    implementation of them (``"grouped_mm"``: one ``torch._grouped_mm`` per weight, ``"eager"``: a loop of linears)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, num_local_experts=4,
                           num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    config._experts_implementation = experts
    return MixtralForCausalLM(config)


def _hf_lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    ids, _ = batch
    return _lm_loss(model(input_ids=ids).logits.float(), ids)


#: a Mixture-of-Experts model: a tiny Mixtral, its experts' GEMMs grouped (one of CASES)
MOE = Case("hf_mixtral", _mixtral, _tokens, lambda m, b: _hf_lm_loss(m, b),
           deep="model.layers.1.mlp.experts", param="model.layers.0.mlp.experts.gate_up_proj",
           blocks="model.layers.*", gemm="model.layers.0.self_attn.q_proj", norm="model.layers.0.input_layernorm",
           override="model.layers.1.self_attn.o_proj")


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("torch_encoder", TorchEncoderLM, _tokens, lambda m, b: _lm_loss(m(b[0]).float(), b[0]),
             deep="encoder.layers.1.linear1", param="encoder.layers.0.linear2.weight", blocks="encoder.layers.*",
             gemm="encoder.layers.0.linear1", norm="encoder.layers.0.norm1", override="encoder.layers.0.linear2"),
        Case("torch_mha", MHALM, _tokens, lambda m, b: _lm_loss(m(b[0]).float(), b[0]),
             deep="blocks.1.fc", param="blocks.0.attn.in_proj_weight", blocks="blocks.*",
             gemm="blocks.0.fc", norm="blocks.0.norm", override="blocks.1.fc"),
        Case("torch_lstm", LSTMClassifier, _tokens, lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]),
             deep="blocks.1.lstm", param="blocks.0.lstm.weight_hh_l0", blocks="blocks.*",
             gemm="proj", norm="blocks.0.norm", override="head"),
        Case("bn_cnn", ResNetish, _images, lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]),
             deep="layers.1.conv2", param="layers.0.conv1.weight", blocks="layers.*",
             gemm="fc", norm="layers.0.bn1", override="layers.1.conv2", buffers=True),
        Case("hf_gpt2", _gpt2, _tokens, _hf_lm_loss,
             deep="transformer.h.1.mlp.c_fc", param="transformer.h.0.attn.c_attn.weight", blocks="transformer.h.*",
             gemm="transformer.h.0.mlp.c_fc", norm="transformer.h.0.ln_1", override="transformer.h.1.mlp.c_proj"),
        Case("hf_llama", _llama, _tokens, _hf_lm_loss,
             deep="model.layers.1.mlp.gate_proj", param="model.layers.0.self_attn.q_proj.weight",
             blocks="model.layers.*", gemm="model.layers.0.mlp.up_proj", norm="model.layers.0.input_layernorm",
             override="model.layers.1.mlp.down_proj"),
        Case("hf_bert", _bert, _tokens, lambda m, b: F.cross_entropy(m(input_ids=b[0]).logits.float(), b[1]),
             deep="bert.encoder.layer.1.intermediate.dense", param="bert.encoder.layer.0.attention.self.query.weight",
             blocks="bert.encoder.layer.*", gemm="bert.encoder.layer.0.output.dense",
             norm="bert.encoder.layer.0.output.LayerNorm", override="bert.encoder.layer.1.output.dense"),
        MOE,
    )
}


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


def _first_float(output):
    if isinstance(output, torch.Tensor):
        return output
    return next(t for t in output if isinstance(t, torch.Tensor))


def _replace_first(output, new):
    if isinstance(output, torch.Tensor):
        return new
    items = list(output)
    i = next(i for i, t in enumerate(items) if isinstance(t, torch.Tensor))
    items[i] = new
    return type(output)(items)


class ZooModule(pl.LightningModule):
    """A zoo model under a generic training step, AdamW (weight decay) and a per-step LR schedule.

    Args:
        case: the zoo case (or its name).
        faults: kind -> global step, kinds ``"forward"`` (NaN written into the output of ``case.deep``),
            ``"backward"`` (NaN gradient out of ``case.deep``), ``"param"`` (NaN gradient of ``case.param``) and
            ``"loss"`` (NaN loss); injected by hooks the model owns from construction on, so opkit's before/after
            snapshots see them on both sides.
    """

    def __init__(self, case: Case | str, faults: dict[str, int] | None = None, lr: float = 1e-2,
                 deep: str | None = None, fused: bool = False) -> None:
        super().__init__()
        self.case = CASES[case] if isinstance(case, str) else case
        if deep is not None:  # poison another submodule than the case's own
            self.case = dataclasses.replace(self.case, deep=deep)
        self.model = self.case.build()
        self.faults = dict(faults or {})
        self.lr = lr
        self.fused = fused  # AdamW(fused=True): takes found_inf, so a step can be left out on the device
        if {"forward", "backward"} & set(self.faults):
            # The same hook on every module of the deep one's name in the other blocks, which share its code: a hook on
            # one block only would fail dynamo's guards on the others' hook dicts and read as a hook that someone
            # added mid-run (what the matrix watches opkit for).
            deep, leaf = self.model.get_submodule(self.case.deep), self.case.deep.rsplit(".", 1)[-1]
            for path, module in self.model.named_modules():
                if path.rsplit(".", 1)[-1] == leaf and type(module) is type(deep):
                    module.register_forward_hook(self._poison_output)
        if "param" in self.faults:
            self.model.get_parameter(self.case.param).register_hook(self._poison_grad)

    def _hit(self, kind: str) -> bool:
        return self.faults.get(kind) == self.global_step and self.training

    @torch.compiler.disable  # outside any compiled graph: its reads of the step and the module are no guards of opkit's
    def _poison_output(self, module, args, output):
        if module is not self.model.get_submodule(self.case.deep):
            return None
        if self._hit("forward"):
            out = _first_float(output).clone(memory_format=torch.contiguous_format)
            out.view(-1)[-1] = math.nan  # the last element: a sequence model reads the last step
            return _replace_first(output, out)
        if self._hit("backward"):
            return _replace_first(output, _PoisonGrad.apply(_first_float(output)))
        return None

    def _poison_grad(self, grad):
        return torch.full_like(grad, math.nan) if self._hit("param") else None

    def forward(self, batch):
        return self.case.loss(self.model, batch)

    def training_step(self, batch, batch_idx):
        loss = self(batch)
        if self._hit("loss"):
            loss = loss * math.nan
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused or None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def loader(self, n: int = 48, seed: int = 0) -> DataLoader:
        return self.case.data(n, seed)


def build(name: str, **kwargs) -> ZooModule:
    """The zoo case ``name`` wrapped in a :class:`ZooModule`, seeded so every test sees the same weights."""
    torch.manual_seed(0)
    return ZooModule(name, **kwargs)
