"""PrecisionPolicy's arguments and first table (precision/config.py): each bad value named with the valid ones, the
table a fit starts with under each Trainer precision, and what a CPU without bf16 units is spared."""

import re
import warnings

import pytest

from lightning_opkit.opclass import GOVERNED, NEVER_CAST
from lightning_opkit.precision.config import (
    DEFAULT_RULES,
    check_fp16,
    check_one_low_dtype,
    check_policy_args,
    fit_table,
    initial_table,
)


def _check(rules=None, default="keep", overrides=None, tolerance=0.01):
    check_policy_args(rules, default, overrides, tolerance, {"census_every_n_steps": 0}, {"measure": True})


@pytest.mark.parametrize("kwargs, message", [
    ({"default": "half"}, "Expected `default` to be one of ['fp32', 'bf16', 'fp16', 'keep'], but got 'half'"),
    ({"default": "fp8"}, "'fp8' is a GEMM dtype"),
    ({"rules": "fast"}, "Expected `rules` to be 'auto', a dict"),
    ({"rules": {"copy": "bf16"}}, "`rules` cannot set op class 'copy': the policy never casts it"),
    ({"rules": {"gemm": "bf16"}}, "`rules` names unknown op class 'gemm'; valid classes are ['matmul'"),
    ({"rules": {"norm": "fp8"}}, "`rules['norm']` is 'fp8': float8 runs the GEMMs of Linear layers"),
    ({"overrides": {"head": "half"}}, "`overrides['head']` is 'half'; expected one of ['fp32', 'bf16', 'fp16', 'fp8'"),
    ({"overrides": ["head"]}, "Expected `overrides` to be a dict of module glob -> dtype"),
    ({"tolerance": 1.5}, "tolerance"),
])
def test_each_bad_argument_is_named_with_the_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _check(**kwargs)


def test_good_arguments_pass():
    _check(rules={"matmul": "fp8", "norm": "fp32"}, overrides={"model.head": "fp32"})
    _check(rules="auto")


def test_the_initial_table_covers_every_class_and_keeps_what_it_never_casts():
    table = initial_table(None, "keep")
    assert set(table) == set(GOVERNED) | set(NEVER_CAST)
    assert all(table[c] == "keep" for c in NEVER_CAST)
    assert {c: table[c] for c in DEFAULT_RULES} == DEFAULT_RULES
    assert set(initial_table("auto", "keep")[c] for c in GOVERNED) == {"fp32"}
    assert initial_table({"norm": "bf16"}, "fp32")["norm"] == "bf16"
    assert initial_table(None, "fp32")["pointwise"] == "fp32"  # the default for classes no rule names


def test_under_32_true_a_cpu_without_bf16_units_keeps_the_built_in_table_in_fp32_and_says_so():
    with pytest.warns(UserWarning, match=r"run in fp32 here, where bf16 is emulated"):
        table = fit_table(None, "keep", "32-true", "cpu", hardware="no native bf16 units (AVX2 only)")
    assert all(table[c] == "fp32" for c in DEFAULT_RULES if DEFAULT_RULES[c] == "bf16")
    with pytest.warns(UserWarning, match=r"lowers matmul to bf16"):  # explicit rules run as asked, said before step 1
        explicit = fit_table({"matmul": "bf16"}, "keep", "32-true", "cpu", hardware="no native bf16 units")
    assert explicit["matmul"] == "bf16"
    with pytest.warns(UserWarning, match="lowers matmul to bf16"):
        native = fit_table(None, "keep", "32-true", "cpu", hardware="native bf16 units (amx_bf16)")
    assert native["matmul"] == "bf16"


def test_under_autocast_the_table_takes_the_trainer_s_16_bit_dtype_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_table(None, "keep", "16-mixed", "cpu")["matmul"] == "fp16"
        assert fit_table(None, "keep", "bf16-mixed", "cpu")["matmul"] == "bf16"


def test_fp16_needs_a_scaler_and_one_16_bit_dtype_at_a_time():
    with pytest.raises(ValueError, match="needs loss scaling"):
        check_fp16({"matmul": "fp16"}, [], scaler=False, precision="32-true")
    check_fp16({"matmul": "fp16"}, [], scaler=True, precision="16-mixed")
    with pytest.raises(ValueError, match=r"\['module head'\] in fp16 while Trainer\(precision='bf16-mixed'\)"):
        check_one_low_dtype({"matmul": "bf16"}, {"head": "fp16"}, "bf16-mixed")
    check_one_low_dtype({"matmul": "bf16"}, {"head": "fp16"}, "32-true")
