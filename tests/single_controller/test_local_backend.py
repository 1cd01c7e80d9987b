"""The local backend: same roles, dispatch and error semantics as Ray, in this process."""

import os
import time

import pytest
import torch

from hybridrl.single_controller import ResourcePool, RoleSpec, WorkerError, WorkerGroup

from .toy_workers import LinearWorker, ToyActor, ToyRef, make_rows


def local_group(roles):
    return WorkerGroup(ResourcePool([1]), roles, backend="local")


def test_local_group_runs_in_driver_with_rendezvous_env():
    wg = local_group(RoleSpec(ToyActor, scale=2.0))
    (info,) = wg.info()
    assert info["pid"] == os.getpid() and info["RANK"] == "0" and info["WORLD_SIZE"] == "1"
    out = wg.scale_rows(make_rows(5), offset=1.0)
    assert out.batch["y"].tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]
    assert wg.whoami() == 0
    assert wg.slow_rank(0.0).get() == [0]


def test_local_busy_time_is_the_methods_own_time():
    wg = local_group(RoleSpec(ToyActor))
    assert wg.busy_s == 0.0
    start = time.perf_counter()
    wg.sleep_by_rank(0.2)
    wall = time.perf_counter() - start
    assert 0.2 <= wg.busy_s <= wall
    assert wg.busy_since(start) == wg.busy_s and wg.busy_since(time.perf_counter()) == 0.0


def test_local_colocated_roles_share_objects():
    wg = local_group({"actor": ToyActor, "ref": RoleSpec(ToyRef, uses=("actor",))})
    wg.actor.set_scale(3.0)
    assert wg.ref.actor_scale() == [3.0]
    assert wg.call("ref", "pid") == [os.getpid()]


def test_local_arguments_are_copied_like_ray():
    wg = local_group(LinearWorker)
    data = make_rows(2, dim=4)
    wg.mutate_input(data)
    assert data.batch["x"].abs().sum() > 0


def test_local_raise_gives_worker_error_and_closes_group():
    wg = local_group(ToyActor)
    with pytest.raises(WorkerError, match="rank 0 of 1 raised in fail_on_rank") as info:
        wg.fail_on_rank(0)
    assert "ValueError: bad batch on rank 0" in info.value.remote_traceback
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="shut down after a failure"):
        wg.info()


def test_local_rejects_more_than_one_rank_and_unknown_names():
    with pytest.raises(ValueError, match="world size 2"):
        WorkerGroup(ResourcePool([2]), ToyActor, backend="local")
    with pytest.raises(ValueError, match="allowed: \\['ray', 'local'\\]"):
        WorkerGroup(ResourcePool([1]), ToyActor, backend="mpi")
    with pytest.raises(ValueError, match="listed before it"):
        local_group({"ref": RoleSpec(ToyRef, uses=("actor",)), "actor": ToyActor})
    with pytest.raises(ValueError, match="role name 'shutdown'"):
        local_group({"shutdown": ToyActor})
    wg = local_group({"actor": ToyActor})
    with pytest.raises(AttributeError, match="decorate it with @register"):
        wg.actor.not_registered()
    with pytest.raises(AttributeError, match="no role 'critic'"):
        wg.critic  # noqa: B018


def test_local_constructor_failure_names_init():
    with pytest.raises(WorkerError, match="raised in __init__"):
        local_group(RoleSpec(LinearWorker, seed="not a seed"))


def test_local_linear_worker_trains():
    wg = local_group(LinearWorker)
    data = make_rows(4, dim=4)
    before = wg.score(data).batch["scores"]
    losses = [wg.train_step(data)[0] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert not torch.equal(before, wg.score(data).batch["scores"])


def test_local_shutdown_leaves_the_driver_as_it_found_it():
    """A role that joins a process group in the driver must not leave it (or the rendezvous env)
    behind: a later in-process job would otherwise shard its model over a stale 1-rank group."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    wg = local_group(RoleSpec(ToyActor, scale=1.0))
    assert wg.all_reduce_rank() == [1.0] and dist.is_initialized()
    wg.shutdown()
    assert not dist.is_initialized()
    assert {k: os.environ.get(k) for k in before} == before


def test_local_calls_run_in_the_order_sent_when_awaited():
    """As on a Ray actor: a call sent without waiting runs at the driver's next wait, after the
    calls sent before it, on the arguments as they were when it was sent."""
    wg = local_group(RoleSpec(ToyActor, scale=1.0))
    actor = wg._backend._host.roles["worker"]
    data = make_rows(3)
    first = wg.set_scale.submit(5.0)
    second = wg.scale_rows.submit(data, offset=1.0)
    data.batch["x"].fill_(100.0)  # after sending: the call keeps what was sent
    assert actor.scale == 1.0  # nothing ran yet
    assert second.get().batch["y"].tolist() == [1.0, 6.0, 11.0]  # ran set_scale first
    assert actor.scale == 5.0
    assert first.get() == [None]  # already ran; awaiting it does not run it again
    assert wg.scale_rows(make_rows(2)).batch["y"].tolist() == [0.0, 5.0]


def test_local_failed_call_raises_at_its_own_wait_not_at_a_later_calls():
    wg = local_group(ToyActor)
    failing = wg.fail_on_rank.submit(0)
    later = wg.whoami.submit()
    assert later.get() == 0  # the ranks went on, as Ray's actor would
    with pytest.raises(WorkerError, match="rank 0 of 1 raised in fail_on_rank"):
        failing.get()
    with pytest.raises(RuntimeError, match="shut down after a failure"):
        wg.info()


def test_local_joined_call_takes_the_earlier_calls_output():
    wg = local_group(RoleSpec(ToyActor, scale=2.0))
    data = make_rows(3)
    first = wg.scale_rows.submit(data, offset=1.0)
    assert wg.add_y.submit_joined(data, first).get().batch["z"].tolist() == [1.0, 4.0, 7.0]


def test_local_joined_call_whose_input_failed_fails():
    wg = local_group(ToyActor)
    data = make_rows(2)
    later = wg.add_y.submit_joined(data, wg.fail_rows.submit(data))
    with pytest.raises(WorkerError, match=r"raised in add_y\(\)") as info:
        later.get()
    assert "its input from fail_rows() failed: worker ToyActor (role 'worker') rank 0 of 1 raised" in str(info.value)


def test_local_joined_outputs_must_line_up_with_the_rows():
    wg = local_group(ToyActor)
    data = make_rows(2)
    with pytest.raises(WorkerError, match="cannot union DataProtos of 2 and 1 rows"):
        wg.add_y.submit_joined(data, wg.drop_one_row.submit(data)).get()
