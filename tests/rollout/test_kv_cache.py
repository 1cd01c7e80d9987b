"""StaticKVCache's row bookkeeping: repeated rows, shared prompt slots, compaction."""

from __future__ import annotations

import pytest
import torch

from hybridrl.rollout.kv_cache import StaticKVCache


def filled(spread: int) -> StaticKVCache:
    """2 prompts of 3 slots (prompt 1 left-padded by one), room for 3 samples each and 2 new slots."""
    cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cache.allocate(2, 6, 5, torch.device("cpu"), spread=spread)
    keys = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)
    for layer in range(2):
        cache.write(layer, 0, keys + 100 * layer, -(keys + 100 * layer))
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 0] = False
    cache.prompt_valid()[:, :3] = mask
    cache.length = 3
    return cache


def test_shared_prompts_are_written_once_and_read_by_every_sample():
    copies, shared = filled(1), filled(3)
    copies.repeat_rows(3)
    shared.share_prompts(3)
    assert shared.shared == 3 and shared.rows == copies.rows == 6
    assert shared.source.tolist() == [0, 0, 0, 3, 3, 3]
    for layer in range(2):
        keys, values = copies.layer(layer)
        prompt_keys, prompt_values = shared.prompts(layer)
        # what each sample reads for its prompt slots is its copy's content
        assert torch.equal(prompt_keys[shared.source][:, :, :3], keys[:6, :, :3])
        assert torch.equal(prompt_values[shared.source][:, :, :3], values[:6, :, :3])
    assert torch.equal(shared.valid[:6], copies.valid[:6])
    assert shared.attention_mask().shape == (6, 1, 1, 3) and not shared.attention_mask()[3:, 0, 0, 0].any()
    assert copies.prompts(0) is None
    with pytest.raises(RuntimeError, match="share their prompts"):
        shared.view(0)


def test_compaction_moves_own_slots_and_prompt_pointers_not_prompts():
    cache = filled(3)
    cache.share_prompts(3)
    before = [tensor[:, :, :3].clone() for tensor in cache.prompts(1)]
    for layer in range(2):  # each live row writes its first new slot
        keys, values = cache.layer(layer)
        keys[:6, :, 3] = torch.arange(6, dtype=torch.float32).view(6, 1, 1) + 10 * layer
        values[:6, :, 3] = -keys[:6, :, 3]
    cache.length = 4
    cache.select(torch.tensor([1, 4, 5]))
    assert cache.rows == 3 and cache.source.tolist() == [0, 3, 3]
    keys, values = cache.layer(1)
    assert keys[:3, 0, 3, 0].tolist() == [11.0, 14.0, 15.0] and values[:3, 1, 3, 0].tolist() == [-11.0, -14.0, -15.0]
    assert cache.valid[:3, 0].tolist() == [True, False, False]  # rows of prompt 1 keep its padding
    # the prompts' slots stayed where the prefill wrote them, though row 0 took row 1's own slots
    assert all(torch.equal(tensor[:, :, :3], old) for tensor, old in zip(cache.prompts(1), before))
    cache.free()
    assert cache.buffer is None and cache.source is None and cache.spread == 1


def test_sharing_needs_the_prefill_spread_out():
    cache = filled(1)
    with pytest.raises(RuntimeError, match="spread=3"):
        cache.share_prompts(3)
    with pytest.raises(ValueError, match="need 8 rows"):
        StaticKVCache(1, 1, 4, torch.float32).allocate(2, 6, 5, torch.device("cpu"), spread=4)
