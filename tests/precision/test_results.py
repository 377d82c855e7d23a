"""What rules="auto" measured (precision/results.py): rows looked up, classes in taxonomy order, the table's order and
marks, and the deprecated ``speed``."""

import pytest

from lightning_opkit.core.deprecations import OpkitDeprecationWarning
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements, speed_phrase


def _table():
    return PrecisionMeasurements([
        Measurement("norm", "bf16", time_ratio=1.5, fp32_ms=1.0, calls=4),
        Measurement("matmul", "bf16", time_ratio=0.5, rel_error=3e-3, loss_change=1e-3, grad_cosine=0.99995,
                    fp32_ms=9.0, calls=8),
        Measurement("softmax", "bf16", failed="RuntimeError: no kernel"),
    ], device="cpu: test", loss=2.0, seconds=0.25)


def test_rows_are_found_by_class_and_dtype_and_classes_come_in_taxonomy_order():
    table = _table()
    assert table.get("matmul", "bf16").fp32_ms == 9.0
    assert table.get("matmul", "fp16") is None
    assert table.classes == ["matmul", "norm", "softmax"]
    assert [r.op_class for r in table] == ["norm", "matmul", "softmax"]  # iteration keeps the rows' order


def test_the_table_puts_the_costliest_class_first_and_marks_the_chosen_dtype():
    text = _table().table(chosen={"matmul": "bf16", "norm": "fp32"})
    assert text.startswith("Measured in 0.25 s on cpu: test.")
    lines = [line for line in text.splitlines() if line.startswith("| ") and "op class" not in line]
    assert [line.split("|")[1].strip() for line in lines] == ["matmul", "norm", "softmax"]
    assert lines[0].split("|")[-2].strip() == "yes"
    assert lines[1].split("|")[-2].strip() == "no"
    assert "2.00x faster" in lines[0]
    assert "failed: RuntimeError: no kernel" in lines[2]
    assert str(_table()) == _table().table()


def test_speed_phrases():
    assert speed_phrase(Measurement("matmul", "bf16", time_ratio=2.0)) == "2.00x slower"
    assert speed_phrase(Measurement("matmul", "bf16")) == "-"


def test_speed_is_the_time_ratio_and_warns_that_it_is_deprecated():
    with pytest.warns(OpkitDeprecationWarning, match="time_ratio"):
        assert Measurement("matmul", "bf16", time_ratio=0.7).speed == 0.7
