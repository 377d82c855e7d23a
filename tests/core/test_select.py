"""Module-path globs (core/select.py): `*` one component, `**` any number, bad patterns named with close names."""


import pytest

from examples.vit import TinyViT
from lightning_opkit.core.select import match_rule, resolve_modules


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
