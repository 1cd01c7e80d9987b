"""FSDP2 over 2 gloo processes equals world size 1 on the same batch (losses, grads, params)."""

from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from transformers import AutoModelForCausalLM

from hybridrl.engine import TrainEngine
from hybridrl.utils import cpu_matmul

from .helpers import (
    build_model,
    make_batch,
    make_group_batch,
    params_of,
    pg_loss_fn,
    shared_computed,
)

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("dist_worker.py")


BACKENDS = ["mkl", "onednn"] if cpu_matmul.onednn_available() else ["mkl"]
# The backend whose two-rank run also checks compiled blocks under FSDP2: compiling them is most of
# a run's time (about 90 s on a 2-core Zen 1 with a warm inductor cache, 270 s cold, per run), and
# both backends' ops under torch.compile are checked in one process (test_cpu_matmul.py,
# test_train_engine.py); the default one, whose custom linear ops the compiled graphs call.
COMPILED_BACKEND = BACKENDS[-1]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """Every test below runs with each CPU matmul backend (hybridrl.utils.cpu_matmul), whichever one
    this machine would pick: the ranks get it through HYBRIDRL_CPU_MATMUL, this process directly."""
    saved = cpu_matmul._choice, cpu_matmul._weight_grad_choice
    cpu_matmul._choice = cpu_matmul._weight_grad_choice = request.param  # as the variable sets both
    yield request.param
    cpu_matmul._choice, cpu_matmul._weight_grad_choice = saved


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, backend):
    """Run dist_worker.py as ranks 0 and 1; returns (their result dicts, output dir)."""
    out = tmp_path_factory.mktemp("dist")
    _world_size_1_checkpoint(out / "ckpt_ws1")
    return run_ranks(WORKER, out, HYBRIDRL_CPU_MATMUL=backend,
                     DIST_WORKER_COMPILED="1" if backend == COMPILED_BACKEND else "0"), out


def _world_size_1_checkpoint(path: Path) -> None:
    """The first step of `single` at world size 1, saved for the 2-rank workers to resume from."""
    batch = make_batch(batch_size=12, seed=21)
    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
    engine.train_step(batch, pg_loss_fn(int(batch.batch["response_mask"].sum())))
    engine.save_checkpoint(path)


@pytest.fixture(scope="module")
def single(backend):
    """The same two steps at world size 1 on the whole batches."""
    batches = [make_batch(batch_size=12, seed=s) for s in (21, 22)]
    tokens = [int(b.batch["response_mask"].sum()) for b in batches]
    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5)
    fwd = engine.forward(batches[0], temperature=0.7, calculate_entropy=True)
    m1 = engine.train_step(batches[0], pg_loss_fn(tokens[0]))
    m2 = engine.train_step(batches[1], pg_loss_fn(tokens[1]))
    return {"fwd": fwd, "m1": m1, "m2": m2, "params": params_of(engine.model), "batch": batches[0]}


def test_ranks_run_the_chosen_matmul_backend(two_ranks, backend):
    ranks, _ = two_ranks
    for res in ranks:
        assert res["matmul_backend"] == res["weight_grad_backend"] == backend
        assert (res["onednn_linears"] > 0) == (backend == "onednn")


def test_forward_log_probs_match_world_size_1(two_ranks, single):
    ranks, _ = two_ranks
    for res in ranks:
        want = single["fwd"].batch["log_probs"][res["rows"]]
        torch.testing.assert_close(res["log_probs"], want, rtol=0, atol=2e-6)
        torch.testing.assert_close(res["entropy"], single["fwd"].batch["entropy"][res["rows"]], rtol=0, atol=2e-6)


def test_shared_prompts_across_ranks_match_full_rows_at_world_size_1(two_ranks):
    ranks, _ = two_ranks
    grouped = make_group_batch(prompts=3, group=4, seed=23)
    engine = TrainEngine(build_model(), lr=1e-3, grad_clip=0.5, share_prompts=False)
    fwd = engine.forward(grouped, calculate_entropy=True)
    step = engine.train_step(grouped, pg_loss_fn(int(grouped.batch["response_mask"].sum())))
    for res in ranks:
        computed, _real = res["group_tokens"]
        assert computed == shared_computed(grouped[res["group_rows"]])  # each rank's prompts once
        torch.testing.assert_close(res["group_log_probs"], fwd.batch["log_probs"][res["group_rows"]], rtol=0, atol=5e-6)
        assert res["group_step"]["loss"] == pytest.approx(step["loss"], rel=1e-5)
        assert res["group_step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    # rank 0 could share but rank 1 could not: both ran the full rows
    local = grouped[ranks[0]["group_rows"]]
    alone = TrainEngine(build_model(), lr=1e-3, share_prompts=False).forward(local)
    assert ranks[0]["mixed_computed"] == alone.meta_info["computed_tokens"] > shared_computed(local)
    torch.testing.assert_close(ranks[0]["mixed_log_probs"], alone.batch["log_probs"], rtol=0, atol=2e-6)


def test_dynamic_batching_agrees_on_one_micro_batch_count(two_ranks):
    ranks, _ = two_ranks
    assert ranks[0]["local_count"] > ranks[1]["local_count"]  # the long half needs more on its own
    assert ranks[0]["m1"]["num_micro_batches"] == ranks[1]["m1"]["num_micro_batches"] == ranks[0]["local_count"]


def test_losses_grad_norms_and_params_match_world_size_1(two_ranks, single):
    ranks, _ = two_ranks
    for step in ("m1", "m2"):
        for res in ranks:
            assert res[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5)
            assert res[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
    # AdamW divides by sqrt(v): for an element with a tiny gradient, fp32 rounding from the other
    # reduction order moves the update by a visible fraction of lr (1e-3), hence atol 1e-5.
    for name, (_shape, full) in ranks[0]["full"].items():
        torch.testing.assert_close(full, single["params"][name], rtol=0, atol=1e-5)


def test_fused_log_probs_under_fsdp2_match_world_size_1(two_ranks, single):
    """use_fused_kernels over 2 sharded ranks: the same log-probs, entropy, losses, gradient norms and
    parameters as the usual path at world size 1, with full rows and with shared prompts."""
    ranks, _ = two_ranks
    for res in ranks:
        torch.testing.assert_close(res["fused_log_probs"], single["fwd"].batch["log_probs"][res["rows"]], rtol=0, atol=2e-6)
        torch.testing.assert_close(res["fused_entropy"], single["fwd"].batch["entropy"][res["rows"]], rtol=0, atol=2e-6)
        for step, got in zip(("m1", "m2"), res["fused_steps"]):
            assert got["loss"] == pytest.approx(single[step]["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
    for name, full in ranks[0]["fused_params"].items():
        torch.testing.assert_close(full, single["params"][name], rtol=0, atol=1e-5)
    for res in ranks:  # against the usual path's shared prompts on the same ranks
        torch.testing.assert_close(res["fused_group_log_probs"], res["group_log_probs"], rtol=0, atol=2e-6)
        torch.testing.assert_close(res["fused_group_entropy"], res["group_entropy"], rtol=0, atol=2e-6)
        assert res["fused_group_step"]["loss"] == pytest.approx(res["group_step"]["loss"], rel=1e-5)
        assert res["fused_group_step"]["grad_norm"] == pytest.approx(res["group_step"]["grad_norm"], rel=1e-5)


def test_iter_full_params_gives_full_shapes_on_every_rank(two_ranks, single):
    ranks, _ = two_ranks
    want = {n: tuple(p.shape) for n, p in single["params"].items()}
    for res in ranks:
        assert {n: s for n, (s, _) in res["full"].items()} == want
    sharded = [n for n, s in ranks[0]["local_shapes"].items() if s != want[n]]
    assert sharded, "FSDP2 should hold only a shard of each parameter per rank"


def test_bucketed_gathers_give_each_tensors_full_tensor(two_ranks):
    # iter_full_tensors gathers dim-0 shards a bucket at a time in one all-gather; the same names in
    # module order and the same bits as one full_tensor() each, for one tensor a bucket, a few, and
    # all, on the test model and on one whose odd widths shard unevenly
    ranks, _ = two_ranks
    for res in ranks:
        assert res["buckets_equal"] == [True] * 6
        assert len(res["uneven"]) >= 3 and res["split_rule"]


def test_checkpoint_resume_at_world_size_2_is_bit_identical(two_ranks):
    ranks, _ = two_ranks
    for res in ranks:
        assert res["resumed_equal"]
        assert (res["m2_resumed"]["loss"], res["m2_resumed"]["grad_norm"]) == (res["m2"]["loss"], res["m2"]["grad_norm"])


def test_export_from_two_ranks_reloads(two_ranks):
    ranks, out = two_ranks
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ranks[0]["full"][name][1])


def test_checkpoints_move_between_world_sizes(two_ranks, single):
    # world size 1 -> 2: the workers resumed the unsharded engine's checkpoint and took step 2
    ranks, out = two_ranks
    for res in ranks:
        assert res["m2_from_ws1"]["loss"] == pytest.approx(single["m2"]["loss"], rel=1e-5)
        assert res["m2_from_ws1"]["grad_norm"] == pytest.approx(single["m2"]["grad_norm"], rel=1e-5)
    # world size 2 -> 1: an unsharded engine resumes the 2-rank checkpoint and takes step 2
    batch = make_batch(batch_size=12, seed=22)
    engine = TrainEngine(build_model(seed=7), lr=1e-3, grad_clip=0.5)
    engine.load_checkpoint(out / "ckpt")
    m2 = engine.train_step(batch, pg_loss_fn(int(batch.batch["response_mask"].sum())))
    assert m2["loss"] == pytest.approx(ranks[0]["m2"]["loss"], rel=1e-5)
    assert m2["grad_norm"] == pytest.approx(ranks[0]["m2"]["grad_norm"], rel=1e-5)


def test_compiled_blocks_under_fsdp2_match_world_size_1(two_ranks, single, backend):
    if backend != COMPILED_BACKEND:
        pytest.skip(f"compiled blocks under FSDP2 run with the {COMPILED_BACKEND} backend (COMPILED_BACKEND)")
    ranks, _ = two_ranks
    for res in ranks:
        want = single["fwd"].batch["log_probs"][res["rows"]]
        torch.testing.assert_close(res["compiled_log_probs"], want, rtol=0, atol=1e-5)
        for got, step in zip(res["compiled_steps"], ("m1", "m2")):
            assert got["loss"] == pytest.approx(single[step]["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
