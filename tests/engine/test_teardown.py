"""destroy_distributed frees what still holds the process group before tearing it down."""

import gc

import torch.distributed as dist

from hybridrl.engine import destroy_distributed, init_distributed


class _HoldsTheGroup:
    """An engine-like object in a reference cycle (its modules and hooks refer back to it)."""

    seen: list[bool] = []

    def __init__(self):
        self.group = dist.group.WORLD
        self.me = self

    def __del__(self):
        _HoldsTheGroup.seen.append(dist.is_initialized())


def test_unreachable_holders_of_the_group_are_freed_while_it_exists(one_rank_env):
    # freed only later, during the interpreter's exit, gloo's destructors aborted finished runs
    init_distributed(timeout_s=30)
    gc.disable()  # no automatic collection in between: only destroy_distributed's own
    try:
        _HoldsTheGroup()  # unreachable at once, but a cycle: only the garbage collector frees it
        assert _HoldsTheGroup.seen == []
    finally:
        destroy_distributed()
        gc.enable()
    assert _HoldsTheGroup.seen == [True]
    assert not dist.is_initialized()
