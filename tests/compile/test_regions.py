"""Compiled regions (compile/regions.py), Trainer-free: the recompile limit as dynamo's config says, a region's row
(the cache entries each region's code holds: tests/core/test_dynamo_compat.py)."""

import torch
import torch._dynamo

from lightning_opkit.compile.regions import REGION_HEADERS, Region, recompile_limit


def test_the_recompile_limit_is_dynamo_s():
    assert recompile_limit() == torch._dynamo.config.recompile_limit
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 3
    try:
        assert recompile_limit() == 3
    finally:
        torch._dynamo.config.recompile_limit = before


def test_a_region_s_row_says_how_it_runs_now():
    region = Region("model.blocks.0", calls=10, compiles=1, compile_time_s=0.5, graphs=1, speedup=0.8)
    assert region.runs == "compiled"
    region.slower = True
    assert region.runs == "eager (compiled measured slower)"
    row = region.row()
    assert len(row) == len(REGION_HEADERS)
    assert row[0] == "model.blocks.0"
    assert row[-2:] == ["0.80x", "eager (compiled measured slower)"]
    assert Region("", eager=True).row()[0] == "<LightningModule>"
    assert Region("", eager=True).runs == "eager_on_recompile (recompile limit)"
