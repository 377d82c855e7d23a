"""torchao's private fields behind core/torchao_compat.py, on a real torchao float8 weight wrapper: a torchao release
that moves one fails here first."""

import pytest
import torch

from lightning_opkit.core.ranks import local
from lightning_opkit.core.torchao_compat import float8_dtype, set_scale, wrapped_in


def _wrapper():
    pytest.importorskip("torchao")  # the fp8 extra
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from lightning_opkit.precision.fp8 import gemm_function

    _, _, mm_config = gemm_function("tensorwise")  # as precision/fp8_gather.py builds its wrapper
    return WeightWithDynamicFloat8CastTensor(torch.full((4, 4), 3.0), mm_config, torch.float8_e4m3fn)


def test_the_plain_tensor_inside_the_wrapper_is_what_checks_read():
    wrapped = _wrapper()
    plain = wrapped_in(wrapped)
    assert type(plain) is torch.Tensor
    assert torch.equal(plain, torch.full((4, 4), 3.0))
    assert local(wrapped) is plain  # core/ranks.local unwraps it for the NaN check and the census
    assert wrapped_in(torch.ones(2)) is None
    assert wrapped_in(None) is None


def test_the_wrapper_s_float8_dtype_and_the_scale_its_cast_uses():
    wrapped = _wrapper()
    assert float8_dtype(wrapped) == torch.float8_e4m3fn
    assert hasattr(wrapped, "_precomputed_scale")  # torchao reads it in fsdp_pre_all_gather
    set_scale(wrapped, torch.tensor(2.0))
    assert float(wrapped._precomputed_scale) == 2.0
    set_scale(wrapped, None)
    assert wrapped._precomputed_scale is None
