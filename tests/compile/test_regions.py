"""Compiled regions (compile/regions.py), Trainer-free: a region's row (the recompile limit and the cache entries
each region's code holds: tests/core/test_dynamo_compat.py)."""


from lightning_opkit.compile.regions import REGION_HEADERS, Region


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
