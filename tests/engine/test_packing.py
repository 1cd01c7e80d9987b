"""Padding removal: real lengths and the left-shifted, trimmed micro-batch."""

import torch

from hybridrl.engine.packing import gather_response, pack_rows, real_lengths


def _example():
    # P = 3, R = 3. Row 0: prompt [5,6], response [7] ; row 1: prompt [4,5,6], response [8,9,1]
    ids = torch.tensor([[0, 5, 6, 7, 0, 0], [4, 5, 6, 8, 9, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def test_real_lengths_left_and_right_padding():
    _, mask, _ = _example()
    p, r = real_lengths(mask, 3)
    assert p.tolist() == [2, 3] and r.tolist() == [1, 3]
    # a masked tool token inside the response stays inside the span
    p, r = real_lengths(torch.tensor([[1, 1, 0, 1, 0]]), 3)
    assert p.tolist() == [2] and r.tolist() == [2]


def test_pack_rows_shifts_spans_to_column_zero():
    ids, mask, pos = _example()
    packed = pack_rows(ids, mask, pos, 3)
    assert packed.input_ids.shape == (2, 6)
    assert packed.input_ids[0, :3].tolist() == [5, 6, 7]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert packed.position_ids[0, :3].tolist() == [0, 1, 2]
    assert packed.computed_tokens == 12 and packed.real_tokens == 9
    # trimming: one short row alone is only as wide as its span
    single = pack_rows(ids[:1], mask[:1], pos[:1], 3)
    assert single.input_ids.tolist() == [[5, 6, 7]]


def test_gather_response_aligns_with_prompt_ends():
    ids, mask, pos = _example()
    packed = pack_rows(ids, mask, pos, 3)
    cols = torch.arange(6).expand(2, 6)
    y, valid = gather_response(cols, packed)
    # row 0: prompt of 2 -> first response logit at column 1; row 1: prompt of 3 -> column 2
    assert y[0, 0].item() == 1 and y[1].tolist() == [2, 3, 4]
    assert valid.tolist() == [[True, False, False], [True, True, True]]
    y, _ = gather_response(cols[:, 1:], packed, first_col=1)
    assert y[1].tolist() == [2, 3, 4]


def test_unbroken_spans_are_dense_and_count_positions_over_the_padding():
    ids, mask, pos = _example()
    packed = pack_rows(ids, mask, pos, 3)
    assert packed.dense
    # row 0's padding columns continue its count, so no position restarts inside a row
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]


def test_a_zero_inside_a_span_keeps_the_mask_and_positions():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])  # a masked token inside the response
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack_rows(ids, mask, pos, 3)
    assert not packed.dense
    assert packed.attention_mask.tolist() == [[1, 1, 0, 1, 1]]
    assert packed.position_ids.tolist() == pos.tolist()


def test_positions_that_do_not_count_up_are_not_dense():
    ids, mask, _ = _example()
    pos = torch.zeros_like(ids)  # e.g. a caller's own position scheme
    packed = pack_rows(ids, mask, pos, 3)
    assert not packed.dense and packed.position_ids.tolist() == [[0] * 6, [0] * 6]
