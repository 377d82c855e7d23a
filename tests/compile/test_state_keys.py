"""Checkpoints written by ``torch.compile``'s wrapper (compile/state_keys.py): their ``_orig_mod.`` keys load into
the plain model, nested or at the top, and the user's own ``on_load_checkpoint`` still runs."""

import torch
from torch import nn

from lightning_opkit.compile.state_keys import loading_old_checkpoints, strip_compile_prefix


def test_a_state_dict_saved_through_torch_compile_s_wrapper_loads_into_the_plain_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    wrapped = nn.Sequential(torch.compile(nn.Linear(2, 2)), nn.Sequential(torch.compile(nn.Linear(2, 1))))
    saved = wrapped.state_dict()
    assert any("_orig_mod." in key for key in saved)
    model.load_state_dict(strip_compile_prefix(saved))  # strict: every key matched
    assert torch.equal(model[1][0].weight, wrapped[1][0]._orig_mod.weight)
    assert strip_compile_prefix({"my_orig_mod.w": 1}) == {"my_orig_mod.w": 1}  # a segment, not any substring


def test_the_user_s_hook_runs_after_the_keys_are_mended():
    seen = []
    hook = loading_old_checkpoints(lambda checkpoint: seen.append(dict(checkpoint["state_dict"])))
    hook({"state_dict": {"encoder._orig_mod.w": 1, "head.b": 2}})
    assert seen == [{"encoder.w": 1, "head.b": 2}]
    untouched = {"state_dict": {"w": 1}}
    hook(untouched)
    assert untouched == {"state_dict": {"w": 1}}
