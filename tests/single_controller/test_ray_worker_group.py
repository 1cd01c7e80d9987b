"""Ray worker groups on 2 ranks: dispatch, rendezvous, colocation, parity with local, failures."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hybridrl.single_controller import ResourcePool, RoleSpec, WorkerDiedError, WorkerError, WorkerGroup

from .toy_workers import LinearWorker, ToyActor, ToyRef, make_rows

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie awaiting its parent)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def wait_gone(pids, seconds: float = 30.0) -> list[int]:
    """The pids still running after up to ``seconds`` (empty when all exited)."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if not process_gone(p)]
    return alive


@pytest.fixture(scope="module")
def colocated(ray_session):
    pool = ResourcePool([2], name="sc_test_pool")
    roles = {"actor": RoleSpec(ToyActor, scale=2.0), "ref": RoleSpec(ToyRef, uses=("actor",)),
             "linear": RoleSpec(LinearWorker, seed=3)}
    wg = WorkerGroup(pool, roles, name="sc_colocated")
    yield wg
    pids = wg.worker_pids()
    wg.shutdown()
    pool.release()
    assert wait_gone(pids) == []


def test_ranks_get_rendezvous_env_and_gloo_all_reduce_works(colocated):
    infos = colocated.actor.info()
    assert [i["RANK"] for i in infos] == ["0", "1"]
    assert [i["LOCAL_RANK"] for i in infos] == ["0", "1"]  # one node: local rank = bundle index
    assert {i["WORLD_SIZE"] for i in infos} == {"2"}
    assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in infos}) == 1
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    assert colocated.actor.all_reduce_rank() == [3.0, 3.0]  # (0+1) + (1+1) on every rank


def test_workers_run_at_the_drivers_priority(colocated):
    """Ray's default would start them at nice 15, starved by anything else on the machine."""
    pids = colocated.worker_pids()
    assert pids and all(os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) for pid in pids)


def test_dp_split_pads_five_rows_over_two_ranks(colocated):
    out = colocated.actor.scale_rows(make_rows(5), offset=0.5)
    assert out.batch["y"].tolist() == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.batch["rows_seen"].tolist() == [3] * 5  # rank 1 also got the padding row
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(5)]
    assert out.meta_info == {"rank": 0}
    twice = colocated.actor.sample_twice(make_rows(3))
    assert twice.batch["x"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert colocated.actor.row_count(make_rows(5)) == [3, 3]
    with pytest.raises(ValueError, match="cannot remove 1 padding row"):
        colocated.actor.drop_one_row(make_rows(3))


def test_rank_zero_and_futures(colocated):
    assert colocated.actor.whoami() == 0
    fut = colocated.actor.slow_rank(0.2)  # registered blocking=False
    fut2 = colocated.actor.info.submit()
    assert fut.get() == [0, 1]
    assert [i["RANK"] for i in fut2.get()] == ["0", "1"]


def test_a_call_joins_an_earlier_calls_output_on_each_rank(colocated):
    """submit_joined: rank r's share of the later call is joined on rank r with what the earlier
    call returned there (five rows over two ranks: one padding row), before the driver has it."""
    data = make_rows(5)
    first = colocated.actor.scale_rows.submit(data, offset=1.0)  # y = 2x + 1
    second = colocated.actor.add_y.submit_joined(data, first)
    out = second.get()
    assert out.batch["z"].tolist() == [1.0, 4.0, 7.0, 10.0, 13.0]  # x + (2x + 1)
    assert out.batch["joined_rank"].tolist() == out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert first.get().batch["y"].tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]
    with pytest.raises(ValueError, match="same rows"):
        colocated.actor.add_y.submit_joined(make_rows(4), colocated.actor.scale_rows.submit(data))


def test_busy_time_counts_each_call_once_for_its_slowest_rank(colocated):
    before, start = colocated.busy_s, time.perf_counter()
    assert colocated.actor.sleep_by_rank(0.3) == [0, 1]  # rank 0 works 0.3 s, rank 1 0.6 s, concurrently
    wall, busy = time.perf_counter() - start, colocated.busy_s - before
    assert 0.6 <= busy <= wall  # the slowest rank, not the 0.9 s sum; dispatch and transfer are outside it
    assert colocated.actor.slow_rank(0.2).get() == [0, 1]  # futures count when collected
    assert colocated.busy_s - before >= 0.8


def test_busy_since_counts_a_call_sent_earlier_only_from_then(colocated):
    before = colocated.busy_s
    future = colocated.actor.slow_rank(0.6)  # runs while the driver goes on, like an early generation
    time.sleep(0.4)
    start = time.perf_counter()
    assert future.get() == [0, 1]
    wall = time.perf_counter() - start
    assert colocated.busy_s - before >= 0.6  # the running total counts the whole call
    assert colocated.busy_since(start) <= wall  # a window counts only what can have run inside it
    assert colocated.busy_since(start - 1.0) >= 0.6


def test_colocated_roles_share_one_process(colocated):
    actor_pids = [i["pid"] for i in colocated.actor.info()]
    assert colocated.ref.pid() == actor_pids == colocated.worker_pids()
    colocated.actor.set_scale(5.0)
    assert colocated.ref.actor_scale() == [5.0, 5.0]  # the ref holds the actor object itself
    colocated.actor.set_scale(2.0)


def linear_run(score, train_step, data):
    """scores before, the loss of one SGD step, scores after: (B, 3), float, (B, 3)."""
    before = score(data).batch["scores"]
    loss = train_step(data)[0]
    return before, loss, score(data).batch["scores"]


def test_local_backend_matches_one_rank_ray_and_two_ranks(colocated):
    data = make_rows(5, dim=4)
    with WorkerGroup(ResourcePool([1]), RoleSpec(LinearWorker, seed=3), backend="local") as wg:
        expected = linear_run(wg.score, wg.train_step, data)
    pool = ResourcePool([1], name="sc_parity")
    with WorkerGroup(pool, RoleSpec(LinearWorker, seed=3)) as wg:
        one_rank = linear_run(wg.score, wg.train_step, data)
        with pytest.raises(RuntimeError, match="max_colocate_count"):
            WorkerGroup(pool, ToyActor)  # the pool is taken: max_colocate_count=1
    pool.release()
    # 2 ranks: the forward is row-wise, so the split does not change it; each rank steps on all 5 rows
    two_ranks = linear_run(colocated.linear.score, colocated.linear.train_step, data)
    for got in (one_rank, two_ranks):
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        assert got[1] == expected[1]
        torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)


def test_raising_worker_gives_traceback_and_kills_the_group(ray_session):
    pool = ResourcePool([2], name="sc_raise_pool")
    wg = WorkerGroup(pool, ToyActor, name="sc_raise")
    pids = wg.worker_pids()
    with pytest.raises(WorkerError) as info:
        wg.fail_on_rank(1)
    err = info.value
    assert (err.rank, err.world_size, err.method, err.role, err.worker_class) == (1, 2, "fail_on_rank", "worker", "ToyActor")
    assert err.pid == pids[1]
    assert "ValueError: bad batch on rank 1" in str(err)
    assert "toy_workers.py" in err.remote_traceback
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down after a failure: worker ToyActor"):
        wg.info()
    pool.release()


def test_rank_exiting_mid_collective_stops_the_call(ray_session):
    pool = ResourcePool([2], name="sc_exit_pool")
    wg = WorkerGroup(pool, ToyActor, name="sc_exit")
    pids = wg.worker_pids()
    # rank 0 blocks in all_reduce waiting for rank 1, which exits: the call must fail, not hang
    with pytest.raises(WorkerDiedError) as info:
        wg.exit_during_collective(1)
    assert (info.value.rank, info.value.method) == (1, "exit_during_collective")
    assert "rank 1 of 2 died" in str(info.value)
    assert wait_gone(pids) == []  # rank 0, stuck in gloo, was killed too
    pool.release()


def test_a_dead_rank_is_reported_before_its_peers_errors(ray_session):
    # the peers' errors reach the driver first; the rank that died is still the one reported
    pool = ResourcePool([2], name="sc_race_pool")
    wg = WorkerGroup(pool, ToyActor, name="sc_race")
    with pytest.raises(WorkerDiedError) as info:
        wg.peer_error_before_death(1)
    assert (info.value.rank, info.value.method) == (1, "peer_error_before_death")
    pool.release()


def test_pool_that_cannot_be_scheduled_fails_with_resources(ray_session):
    pool = ResourcePool([2], num_cpus_per_worker=64, name="sc_too_big", ready_timeout_s=2)
    with pytest.raises(RuntimeError, match="not scheduled within 2s.*available"):
        WorkerGroup(pool, ToyActor)


DRIVER = textwrap.dedent(
    """
    import json, sys
    from hybridrl.single_controller import Dispatch, ResourcePool, Worker, WorkerGroup, init_ray, register

    class Boom(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def pid(self):
            import os
            return os.getpid()

        @register(Dispatch.ONE_TO_ALL)
        def step(self):
            if self.rank == 1:
                raise KeyError("missing column on purpose")

    init_ray(num_cpus=1)
    wg = WorkerGroup(ResourcePool([2]), Boom)
    print(json.dumps(wg.pid()), flush=True)
    wg.step()
    print("unreachable", flush=True)
    """
)


def test_driver_exits_nonzero_with_worker_traceback_and_no_orphans(ray_session, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "unreachable" not in proc.stdout
    assert "WorkerError: worker Boom (role 'worker') rank 1 of 2 raised in step()" in proc.stderr
    assert "KeyError: 'missing column on purpose'" in proc.stderr
    pids = [int(p) for p in proc.stdout.splitlines()[0].strip("[]").split(",")]
    assert wait_gone(pids) == []
