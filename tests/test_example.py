import os
import sys

import yaml
from helpers import read_events
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from examples.train import main  # noqa: E402
from examples.vit import DigitsDataModule, TinyViT, load_digits_tensors  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "config.yaml")


def test_digits_ship_with_the_package():
    images, labels = load_digits_tensors()
    assert images.shape == (1797, 1, 8, 8)
    assert images.min() >= 0.0
    assert images.max() <= 1.0
    assert set(labels.tolist()) == set(range(10))


def test_vit_has_every_layer_kind():
    kinds = {type(m).__name__ for m in TinyViT().modules()}
    assert {"Conv2d", "LayerNorm", "Linear", "GELU", "Attention"} <= kinds


def test_config_trains_with_every_callback_and_logs(tmp_path, recwarn):
    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    names = [c["class_path"].rsplit(".", 1)[1] for c in config["trainer"]["callbacks"]]
    assert names == ["PrecisionPolicy", "NaNDetector", "ProfilerWindows", "ActivationCheckpointing", "TorchCompile"]
    # 20 steps: the checkpointing price begins after TorchCompile's eager-against-compiled calls (one timed trial at
    # a time), then counts two steps and times six
    cli = main(["--config", CONFIG, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_epochs", "2",
                "--trainer.limit_train_batches", "10", "--trainer.limit_val_batches", "2",
                "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--trainer.callbacks.init_args.backend", "eager"], run=False)
    opkit = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert [type(c).__name__ for c in opkit] == names
    assert opkit[0].rules == "auto"
    assert opkit[0].overrides == {"model.head": "fp32"}
    assert opkit[1].action == "skip"
    assert opkit[1].spike_zscore == 6.0
    assert opkit[2].memory_breakdown
    assert opkit[4].backend == "eager"
    opkit[2].every_n_steps = 5  # windows inside 20 steps
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 20
    # nothing a user could not act on: expected recompiles are counted, not warned about
    ours = [str(w.message) for w in recwarn if ("opkit" in str(w.message) or "TorchCompile" in str(w.message))
            and not str(w.message).startswith("LightningCLI's args parameter")]  # names pytest's argv
    assert ours == []
    scalars, texts = read_events(str(tmp_path))
    assert "train/loss" in scalars
    assert "opkit/precision/matmul/calls" in scalars
    assert "opkit/profiler/step_time_ms" in scalars
    assert "opkit/compile/compiles" in scalars
    assert "opkit/memory/activations_mb" in scalars
    assert opkit[3].checkpointed == [f"model.blocks.{i}" for i in range(4)]
    assert opkit[3].price is not None
    assert scalars["opkit/checkpointing/saved_cut"][-1][1] > 0.4  # the blocks hold most of what the step saves
    assert "opkit/nan/spikes" in scalars
    assert "opkit/precision/policy" in texts
    assert "opkit/precision/decision" in texts
    sensitivity = texts["opkit/precision/sensitivity"][0][1]
    assert "| matmul | bf16 |" in sensitivity
    assert "| attention |" not in sensitivity
    assert set(opkit[0].decisions) == {"matmul", "conv", "norm", "softmax", "activation", "loss", "reduction",
                                       "pointwise"}
    assert DigitsDataModule().batch_size == 64
    # the Graphs tab shows the ViT, module by module (TensorBoard's own reader), and the windows pushed named ranges
    assert opkit[2].graph
    assert opkit[2].ranges == "windows"
    (logs,) = {d for d, _, files in os.walk(tmp_path) for f in files if f.startswith("events.out.tfevents.")}
    accumulator = EventAccumulator(logs)
    accumulator.Reload()
    nodes = {node.name for node in accumulator.Graph().node}
    assert {"model/blocks/0/attn/qkv/linear", "model/blocks/3/mlp/0/linear", "model/head/linear"} <= nodes
    assert opkit[2].range_marks.pushed > 0


def test_short_class_names_and_a_dtype_typo_fails_at_parse_time(tmp_path, capsys):
    import pytest

    cli = main(["--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+=NaNDetector",
                "--trainer.callbacks.init_args.action=skip", "--trainer.callbacks+=PrecisionPolicy",
                "--trainer.callbacks.init_args.rules={matmul: fp32}", "--trainer.callbacks+=PrecisionPolicy",
                "--trainer.callbacks.init_args.rules=auto"], run=False)
    opkit = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert [type(c).__name__ for c in opkit] == ["NaNDetector", "PrecisionPolicy", "PrecisionPolicy"]
    # each flag binds to the one before it
    assert opkit[0].action == "skip"
    assert opkit[1].rules == {"matmul": "fp32"}
    assert opkit[2].rules == "auto"
    with pytest.raises(SystemExit):
        main(["--trainer.callbacks+=PrecisionPolicy", "--trainer.callbacks.init_args.rules={matmul: bf61}"],
             run=False)
    assert "bf61" in capsys.readouterr().err
