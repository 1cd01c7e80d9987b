"""fsdp_size=1 over 2 gloo processes: whole-model replicas that sum their gradients equal world
size 1 on the same batches, stay bit-identical, and checkpoint to and from FSDP2 shards; FSDP2's
reshard_after_forward=False and forward_prefetch give the same steps; fsdp_size=2 over 4 processes
(HSDP) does too."""

from pathlib import Path

import pytest
import torch
from ranks import run_ranks

from hybridrl.engine import TrainEngine

from .helpers import build_model, make_batch, params_of, pg_loss_fn

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("replica_worker.py")
HSDP_WORKER = Path(__file__).with_name("hsdp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORKER, tmp_path_factory.mktemp("replicas"))


@pytest.fixture(scope="module")
def single():
    """The same two steps at world size 1 on the whole batches."""
    batches = [make_batch(batch_size=12, seed=s) for s in (21, 22)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
    fwd = engine.forward(batches[0], temperature=0.7, calculate_entropy=True)
    fwd_plain = engine.forward(batches[0], temperature=0.7)
    m1 = engine.train_step(batches[0], pg_loss_fn(tokens[0]))
    m2 = engine.train_step(batches[1], pg_loss_fn(tokens[1]))
    return {"fwd": fwd, "fwd_plain": fwd_plain, "m1": m1, "m2": m2, "params": params_of(engine.model)}


def _same_step(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_replicas_start_from_rank_0s_weights(ranks):
    assert ranks[0]["world"] == 2
    assert [r["start_equal"] for r in ranks] == [True, True]  # rank 1 was built from another seed


def test_replicas_match_world_size_1_and_stay_identical(ranks, single):
    for res in ranks:
        torch.testing.assert_close(res["log_probs"], single["fwd"].batch["log_probs"][res["rows"]], rtol=0, atol=2e-6)
        _same_step(res["m1"], single["m1"])
        _same_step(res["m2"], single["m2"])
    # rank 0 ran more micro-batches than rank 1 (token budget): no common count needed
    assert ranks[0]["m1"]["num_micro_batches"] > ranks[1]["m1"]["num_micro_batches"]
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name  # the same AdamW step on the same sums
        torch.testing.assert_close(p, single["params"][name], rtol=0, atol=1e-5)
    assert ranks[0]["full_names"] == list(single["params"])


def test_replica_checkpoints_resume_exactly_and_move_to_and_from_shards(ranks, single):
    for res in ranks:
        assert res["resumed_equal"]
        assert (res["m2_resumed"]["loss"], res["m2_resumed"]["grad_norm"]) == (res["m2"]["loss"], res["m2"]["grad_norm"])
        _same_step(res["m2_sharded"], single["m2"])
        _same_step(res["m2_from_shards"], single["m2"])


def test_fsdp_keeping_gathered_blocks_and_prefetching_match_world_size_1(ranks, single):
    for res in ranks:
        _same_step(res["kept_steps"][0], single["m1"])
        _same_step(res["kept_steps"][1], single["m2"])


def test_gradients_missing_on_some_ranks_count_as_zeros_there(ranks):
    for res in ranks:
        assert torch.equal(res["partial"]["a"], torch.full((3,), 3.0))  # 1 + 2
        assert torch.equal(res["partial"]["b"], torch.tensor([1.0, 2.0, 3.0]))  # rank 0's + zeros
        assert res["partial"]["c"] is None  # no rank had one: left alone, as at world size 1


def test_a_shard_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="fsdp_size=0"):
        TrainEngine(build_model(), lr=1e-3, fsdp_size=0)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """fsdp_size=2 over 4 ranks: shard groups of two, replicated twice (HSDP)."""
    return run_ranks(HSDP_WORKER, tmp_path_factory.mktemp("hsdp"), world=4)


def test_hsdp_shards_within_groups_and_matches_world_size_1(hsdp, single):
    for res in hsdp:
        assert res["mesh"] == ((2, 2), ("replicate", "shard"))
        torch.testing.assert_close(res["log_probs"], single["fwd_plain"].batch["log_probs"][res["rows"]],
                                   rtol=0, atol=2e-6)
        _same_step(res["m1"], single["m1"])
        _same_step(res["m2"], single["m2"])
        # each parameter split over the two ranks of a shard group, not over all four
        assert {n: r for n, r in res["local_rows"].items()} == {
            n: -(-p.shape[0] // 2) for n, p in single["params"].items()}
        assert res["synced"] == list(single["params"])
        for name, p in res["full"].items():
            assert torch.equal(p, hsdp[0]["full"][name])
            torch.testing.assert_close(p, single["params"][name], rtol=0, atol=1e-5)


def test_hsdp_checkpoints_resume_exactly_and_move_to_full_shards(hsdp, single):
    for res in hsdp:
        assert res["resumed_equal"]
        assert (res["m2_resumed"]["loss"], res["m2_resumed"]["grad_norm"]) == (res["m2"]["loss"], res["m2"]["grad_norm"])
        _same_step(res["m2_sharded"], single["m2"])
