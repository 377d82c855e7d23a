"""The policy's dtype names and what this device offers (precision/dtypes.py), the hardware read independently from
/proc/cpuinfo by this test."""

import pathlib
import typing

import pytest
import torch

from lightning_opkit.opclass import GOVERNED
from lightning_opkit.precision.dtypes import (
    DTYPES,
    FP8_NEXT,
    NAMES,
    DtypeName,
    OpClassName,
    describe_device,
    hardware_note,
    mode_dtype,
)


def _flags() -> set[str]:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def test_the_cli_s_literals_are_the_names_the_policy_takes():
    assert list(typing.get_args(DtypeName)) == NAMES
    assert set(typing.get_args(OpClassName)) == set(GOVERNED)
    assert DTYPES["keep"] is None
    assert mode_dtype("fp8") == DTYPES[FP8_NEXT] == torch.bfloat16  # a float8 class's other ops run in bf16
    assert mode_dtype("fp16") == torch.float16


@pytest.mark.skipif(not _flags(), reason="no /proc/cpuinfo flags on this machine")
def test_the_cpu_note_says_what_the_cpu_flags_say():
    flags = _flags()
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    note = hardware_note("cpu", "bf16")
    if native:
        assert note == f"native bf16 units ({', '.join(native)})"
    else:
        assert note.startswith("no native bf16 units")
    assert hardware_note("cpu", "fp32") == ""
    assert describe_device("cpu").startswith("cpu: ")
    assert describe_device("cpu").endswith(f"; bf16: {note}")
    assert f"{torch.get_num_threads()} threads" in describe_device("cpu", hardware=False)
