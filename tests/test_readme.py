"""The README's "In your own code" snippet runs as written, and on another model than the one it names."""

import os
import pathlib
import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def _snippet() -> str:
    text = pathlib.Path(README).read_text()
    section = text[text.index("In your own code"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class TinyTransformer:
    """Lightning's demo LightningTransformer, small, on random tokens (its own dataloader downloads WikiText-2)."""

    @staticmethod
    def make():
        from lightning.pytorch.demos import LightningTransformer, Transformer

        class Model(LightningTransformer):
            def __init__(self):
                super().__init__(vocab_size=64)
                self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2)

            def prepare_data(self):
                pass

            def train_dataloader(self):
                g = torch.Generator().manual_seed(0)
                return DataLoader(TensorDataset(torch.randint(0, 64, (40, 16), generator=g),
                                                torch.randint(0, 64, (40, 16), generator=g)), batch_size=4)

        return Model()


@pytest.mark.parametrize("model", ["as written", "LightningTransformer"])
def test_readme_snippet_runs(tmp_path, monkeypatch, capsys, model):
    monkeypatch.chdir(tmp_path)
    code = _snippet()
    if model != "as written":
        assert "model = BoringModel()" in code
        code = code.replace("model = BoringModel()", "model = TinyTransformer.make()")
    namespace = {"TinyTransformer": TinyTransformer}
    exec(compile(code, README, "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 20
    out = capsys.readouterr().out
    assert "opkit run summary (fit finished, global step 20)" in out
    assert "tensorboard --logdir" in out
    assert os.listdir(tmp_path / "lightning_logs" / "version_0" / "traces")
    if model == "as written":
        assert "['layer (Linear)']" in out
    else:
        assert "model.transformer.encoder.layers.0" in out
        assert "model.transformer.decoder.layers.1" in out


def test_measure_precision_snippet_runs_as_written(capsys):
    text = (pathlib.Path(README).parent / "docs" / "callbacks" / "precision-policy.md").read_text()
    section = text[text.index("The same measurement without a Trainer"):]
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), {})
    out = capsys.readouterr().out
    assert "| matmul | bf16 |" in out
    assert "'matmul': '" in out
