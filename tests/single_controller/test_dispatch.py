"""Split/merge rules of the dispatch modes, without any backend."""

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, collect_results, plan_call, register, registered_methods

from .toy_workers import ToyActor, make_rows


def test_one_to_all_sends_same_args_to_every_rank():
    plan = plan_call(Dispatch.ONE_TO_ALL, 3, (1, "a"), {"k": 2})
    assert plan.ranks == (0, 1, 2)
    assert all(c == ((1, "a"), {"k": 2}) for c in plan.calls)
    assert collect_results(plan, ["r0", "r1", "r2"]) == ["r0", "r1", "r2"]


def test_rank_zero_runs_only_rank_zero():
    plan = plan_call(Dispatch.RANK_ZERO, 4, (7,), {})
    assert plan.ranks == (0,)
    assert collect_results(plan, ["only"]) == "only"


def test_dp_pads_five_rows_over_two_ranks_and_unpads():
    data = make_rows(5)
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (data,), {"offset": 1.0})
    shards = [args[0] for args, _ in plan.calls]
    assert [len(s) for s in shards] == [3, 3]
    # the padding row is a copy of row 0 at the end of the last shard
    assert shards[1].batch["x"].tolist() == [3.0, 4.0, 0.0]
    assert shards[1].non_tensor_batch["uid"].tolist() == ["u3", "u4", "u0"]
    assert all(kwargs == {"offset": 1.0} for _, kwargs in plan.calls)
    assert (plan.rows, plan.pad_size) == (6, 1)
    merged = collect_results(plan, [DataProto.from_dict({"y": s.batch["x"] * 2}) for s in shards])
    assert merged.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_dp_unpads_k_rows_per_input_row():
    data = make_rows(3)
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (), {"data": data})
    outs = [kwargs["data"].repeat(2) for _, kwargs in plan.calls]
    merged = collect_results(plan, outs)
    assert merged.batch["x"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_dp_rejects_unaligned_outputs_when_padded():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make_rows(3),), {})
    outs = [args[0][1:] for args, _ in plan.calls]
    with pytest.raises(ValueError, match="cannot remove 1 padding row"):
        collect_results(plan, outs)


def test_dp_without_padding_concatenates_any_sizes():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make_rows(4),), {})
    outs = [args[0][1:] for args, _ in plan.calls]
    assert collect_results(plan, outs).batch["x"].tolist() == [1.0, 3.0]


def test_dp_non_proto_results_come_back_per_rank():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make_rows(4),), {})
    assert collect_results(plan, [{"loss": 1.0}, {"loss": 2.0}]) == [{"loss": 1.0}, {"loss": 2.0}]


def test_dp_argument_errors_are_explicit():
    with pytest.raises(TypeError, match="needs at least one DataProto"):
        plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (torch.ones(2),), {})
    with pytest.raises(ValueError, match="differ in row count"):
        plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make_rows(2),), {"other": make_rows(3)})
    with pytest.raises(ValueError, match="empty DataProto"):
        plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make_rows(0),), {})


def test_register_records_mode_and_rejects_bad_mode():
    methods = registered_methods(ToyActor)
    assert methods["scale_rows"].dispatch_mode is Dispatch.DP_COMPUTE_PROTO
    assert methods["slow_rank"].blocking is False
    assert "not_registered" not in methods
    with pytest.raises(TypeError, match="Dispatch.ONE_TO_ALL"):
        register("one_to_all")
