"""Decisions taken together by every rank (core/ranks.py): the identity alone, the same answer on every rank of a real
two-process gloo group, and DTensors read by their local shard."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_opkit.core.ranks import Ranks, local, local_floats


def test_alone_every_call_is_the_identity():
    ranks = Ranks(torch.device("cpu"))
    assert (ranks.active, ranks.world, ranks.rank) == (False, 1, 0)
    assert ranks.any(False) is False
    assert ranks.gather({"a": 1}) == [{"a": 1}]
    assert ranks.from_rank("mine", 0) == "mine"


def test_local_floats_finds_non_empty_floating_tensors_in_nested_outputs():
    out = local_floats({"a": [torch.ones(2), torch.arange(2)], "b": (torch.empty(0), torch.zeros(1, dtype=torch.half))})
    assert [t.dtype for t in out] == [torch.float32, torch.float16]
    plain = torch.ones(2)
    assert local(plain) is plain


def _worker(rank: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        ranks = Ranks(torch.device("cpu"))
        answers = [ranks.any(rank == 1), ranks.any(False), ranks.gather(rank * 10), ranks.from_rank(f"r{rank}", 1)]
        mesh = init_device_mesh("cpu", (2,))
        sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        answers.append(local(sharded).tolist())  # this rank's shard: no collective
        torch.save(answers, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_take_the_same_decision_and_read_their_own_shards(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    got = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    for rank, answers in enumerate(got):
        assert answers[:4] == [True, False, [0, 10], "r1"]
        assert answers[4] == [2.0 * rank, 2.0 * rank + 1]
