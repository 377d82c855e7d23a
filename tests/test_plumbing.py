import os
import pathlib
import re

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyNet, make_loader, read_events
from torch import nn

from examples.vit import TinyViT
from lightning_opkit.core import tags
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.select import match_rule, resolve_modules
from lightning_opkit.core.tags import TAGS, UnlistedTagWarning, markdown
from lightning_opkit.core.text import markdown_table


class _Writes(pl.Callback):
    def __init__(self, log_dir=None):
        self.given = log_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w = LogWriter(trainer, self.given)
        w.scalar("opkit/nan/events", batch_idx * 1.5, trainer.global_step)
        w.table("opkit/profiler/top_ops", ["a", "b"], [[1, 2.5]], trainer.global_step)
        w.close()
        self.log_dir = w.log_dir


def test_writes_to_the_trainers_tensorboard_logger(tmp_path):
    cb = _Writes()
    pl.Trainer(default_root_dir=tmp_path, max_steps=3, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=pl.loggers.TensorBoardLogger(tmp_path)).fit(TinyNet(), make_loader())
    assert cb.log_dir == os.path.join(tmp_path, "lightning_logs", "version_0")
    scalars, texts = read_events(cb.log_dir)
    assert scalars["opkit/nan/events"] == [(1, 0.0), (2, 1.5), (3, 3.0)]
    assert "| 1 | 2.500 |" in texts["opkit/profiler/top_ops"][0][1]


def test_without_a_logger_nothing_is_written_unless_a_log_dir_is_given(tmp_path):
    cb = _Writes()
    pl.Trainer(default_root_dir=tmp_path / "root", max_steps=2, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=False).fit(TinyNet(), make_loader())
    assert not os.path.exists(tmp_path / "root")  # logger=False: no file
    cb = _Writes(str(tmp_path / "asked"))
    pl.Trainer(default_root_dir=tmp_path / "root", max_steps=2, callbacks=[cb], enable_progress_bar=False,
               enable_checkpointing=False, logger=False).fit(TinyNet(), make_loader())
    assert cb.log_dir == str(tmp_path / "asked")
    assert read_events(cb.log_dir)[0]["opkit/nan/events"] == [(1, 0.0), (2, 1.5)]


def test_a_tag_the_reference_does_not_list_warns_once(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False), log_dir=str(tmp_path))
    with pytest.warns(UnlistedTagWarning, match="scalar 'opkit/nan/evnets'.*core/tags.py does not list"):
        writer.scalar("opkit/nan/evnets", 1.0, 0)
    with pytest.warns(UnlistedTagWarning, match="text 'opkit/nan/events'"):  # listed as a scalar, not a text
        writer.text("opkit/nan/events", "x", 0)
    writer.scalar("opkit/profiler/matmul/self_ms", 1.0, 0)  # <class> families are listed once
    writer.close()


def test_the_tag_reference_page_is_made_from_the_list_and_each_listed_tag_is_written_somewhere():
    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "tags.md")
    with open(page) as f:
        assert f.read() == markdown(), "docs/tags.md is stale: make docs-tags"
    source = "".join(p.read_text() for p in pathlib.Path(os.path.dirname(tags.__file__)).parent.rglob("*.py")
                     if p.name != "tags.py")
    for tag in TAGS:  # its last part appears in the code that writes it, as the tag or as a scalar's key
        assert re.search(rf"[\"/']{re.escape(tag.name.rsplit('/', 1)[1])}[\"']", source), tag.name


def test_markdown_table_escapes_pipes():
    assert markdown_table(["x"], [["a|b"]]).splitlines()[-1] == "| a\\|b |"


def test_resolve_modules_globs_and_close_names():
    model = TinyViT(depth=3)
    names = [n for n, _ in resolve_modules(model, ["blocks.*.attn"])]
    assert names == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    with pytest.raises(ValueError, match=r"'blocks.\*.atn'.*blocks.0.attn"):
        resolve_modules(model, ["blocks.*.atn"])


def test_match_rule_most_specific_wins():
    rules = {"blocks.*": "fp32", "blocks.*.attn": "bf16"}
    assert match_rule("blocks.1.attn", rules) == "bf16"
    assert match_rule("blocks.1", rules) == "fp32"
    assert match_rule("blocks.1.mlp", rules) is None  # `*` is one component; the policy applies blocks.1's rule
    assert match_rule("blocks.1.mlp", {"blocks.**": "fp32"}) == "fp32"
    assert match_rule("head", rules) is None


def test_star_is_one_component_and_double_star_any_number():
    model = TinyViT(depth=2)
    assert [n for n, _ in resolve_modules(model, ["blocks.*"])] == ["blocks.0", "blocks.1"]
    deep = [n for n, _ in resolve_modules(model, ["blocks.**"])]
    assert "blocks.0.attn" in deep
    assert "blocks" in deep
    assert len(deep) > 3
    assert [n for n, _ in resolve_modules(model, ["**.attn"])] == ["blocks.0.attn", "blocks.1.attn"]


def test_every_bad_pattern_is_named_at_once_with_the_callback():
    from lightning_opkit import NaNDetector

    model = TinyViT(depth=2)
    with pytest.raises(ValueError, match=r"NaNDetector\(`modules`\): 2 pattern\(s\).*'blockz.\*'.*'hed'"):
        resolve_modules(model, ["blockz.*", "blocks.*", "hed"], owner="NaNDetector")
    with pytest.raises(ValueError, match=r"`modules` is an empty list"):
        NaNDetector(modules=[])


def test_patches_restore_idempotently():
    module = nn.Linear(2, 2)
    patches = Patches()
    patches.set(module, "forward", lambda x: x)
    patches.hold(module.register_forward_hook(lambda *a: None))
    assert torch.equal(module(torch.ones(1, 2)), torch.ones(1, 2))
    patches.restore()
    patches.restore()
    assert "forward" not in vars(module)
    assert not module._forward_hooks


def test_every_logger_of_the_trainer_gets_the_figures(tmp_path):
    """TensorBoard and a CSVLogger side by side: scalars in both, tables and the picture beside metrics.csv."""
    import csv

    from lightning_opkit import NaNDetector, ProfilerWindows

    csv_logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    callbacks = [NaNDetector(action="skip"), ProfilerWindows(every_n_steps=3, warmup=0, active=1, roofline=True,
                                                             export_trace=False)]
    pl.Trainer(default_root_dir=tmp_path, max_steps=5, callbacks=callbacks, enable_progress_bar=False,
               enable_checkpointing=False, enable_model_summary=False,
               logger=[pl.loggers.TensorBoardLogger(tmp_path), csv_logger]).fit(
        TinyNet(forward_steps=(2,)), make_loader())
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    events = [(int(r["step"]), float(r["opkit/nan/events"])) for r in rows if r.get("opkit/nan/events")]
    assert events[0] == (2, 1.0)  # the skipped step's event, at its step
    windows = [float(r["opkit/profiler/step_time_ms"]) for r in rows if r.get("opkit/profiler/step_time_ms")]
    assert len(windows) == 1
    assert windows[0] > 0
    scalars, _ = read_events(str(tmp_path / "lightning_logs"))
    assert scalars["opkit/profiler/step_time_ms"][0][1] == pytest.approx(windows[0])
    assert scalars["opkit/nan/events"][0] == (2, 1.0)
    folder = os.path.join(csv_logger.log_dir, "opkit")
    with open(os.path.join(folder, "nan_report.md")) as f:
        assert "Non-finite output at global step 2" in f.read()
    with open(os.path.join(folder, "profiler_roofline.md")) as f:
        assert "| class | dtype |" in f.read()
    with open(os.path.join(folder, "profiler_roofline_plot.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
