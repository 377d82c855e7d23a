"""The tag reference (core/tags.py): every tag written is listed, and docs/tags.md is made from the list."""

import os
import pathlib
import re

import lightning.pytorch as pl
import pytest
from helpers import ROOT

from lightning_opkit.core import tags
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.tags import TAGS, UnlistedTagWarning, markdown


def test_a_tag_the_reference_does_not_list_warns_once(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False), log_dir=str(tmp_path))
    with pytest.warns(UnlistedTagWarning, match="scalar 'opkit/nan/evnets'.*core/tags.py does not list"):
        writer.scalar("opkit/nan/evnets", 1.0, 0)
    with pytest.warns(UnlistedTagWarning, match="text 'opkit/nan/events'"):  # listed as a scalar, not a text
        writer.text("opkit/nan/events", "x", 0)
    writer.scalar("opkit/profiler/matmul/self_ms", 1.0, 0)  # <class> families are listed once
    writer.close()


def test_the_tag_reference_page_is_made_from_the_list_and_each_listed_tag_is_written_somewhere():
    page = os.path.join(ROOT, "docs", "tags.md")
    with open(page) as f:
        assert f.read() == markdown(), "docs/tags.md is stale: make docs-tags"
    source = "".join(p.read_text() for p in pathlib.Path(os.path.dirname(tags.__file__)).parent.rglob("*.py")
                     if p.name != "tags.py")
    for tag in TAGS:  # its last part appears in the code that writes it, as the tag or as a scalar's key
        assert re.search(rf"[\"/']{re.escape(tag.name.rsplit('/', 1)[1])}[\"']", source), tag.name
