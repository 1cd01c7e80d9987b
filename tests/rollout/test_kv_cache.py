"""StaticKVCache's row bookkeeping: repeated rows, shared prompt rows, compaction."""

from __future__ import annotations

import pytest
import torch

from hybridrl.rollout.kv_cache import StaticKVCache


def filled(prompt_rows: int) -> StaticKVCache:
    """2 prompts of 3 slots (prompt 1 left-padded by one), room for 3 samples each and 2 new slots."""
    cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cache.allocate(2, 6, 5, torch.device("cpu"), prompt_rows=prompt_rows)
    keys = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)
    for layer in range(2):
        cache.write(layer, 0, keys + 100 * layer, -(keys + 100 * layer))
    cache.valid[1, 0] = False
    cache.length = 3
    return cache


def test_shared_prompts_keep_one_copy_and_point_samples_at_it():
    copies, shared = filled(0), filled(2)
    copies.repeat_rows(3)
    shared.share_prompts(3)
    assert shared.base == 2 and shared.shared == 3 and shared.rows == copies.rows == 6
    assert shared.source.tolist() == [0, 0, 0, 1, 1, 1]
    for layer in range(2):
        prompt_keys, prompt_values = shared.prompt_layer(layer)
        keys, values = copies.layer(layer)
        # what each sample reads for its prompt slots is its copy's content
        torch.testing.assert_close(prompt_keys[shared.source][:, :, :3], keys[:6, :, :3], rtol=0, atol=0)
        torch.testing.assert_close(prompt_values[shared.source][:, :, :3], values[:6, :, :3], rtol=0, atol=0)
    assert torch.equal(shared.live_valid()[:6], copies.live_valid()[:6])
    assert shared.attention_mask().shape == (6, 1, 1, 3) and not shared.attention_mask()[3:, 0, 0, 0].any()
    assert copies.prompt_layer(0) is None
    with pytest.raises(RuntimeError, match="share their prompts"):
        shared.view(0)


def test_compaction_moves_own_slots_and_prompt_pointers():
    cache = filled(2)
    cache.share_prompts(3)
    for layer in range(2):  # each live row writes its first new slot
        keys, values = cache.layer(layer)
        keys[:6, :, 3] = torch.arange(6, dtype=torch.float32).view(6, 1, 1) + 10 * layer
        values[:6, :, 3] = -keys[:6, :, 3]
    cache.length = 4
    cache.select(torch.tensor([1, 4, 5]))
    assert cache.rows == 3 and cache.source.tolist() == [0, 1, 1]
    keys, values = cache.layer(1)
    assert keys[:3, 0, 3, 0].tolist() == [11.0, 14.0, 15.0] and values[:3, 1, 3, 0].tolist() == [-11.0, -14.0, -15.0]
    assert cache.live_valid()[:3, 0].tolist() == [True, False, False]  # rows of prompt 1 keep its padding
    assert cache.prompt_layer(0)[0].shape[0] == 2  # the prompts stay where they were
    cache.free()
    assert cache.buffer is None and cache.source is None and cache.base == 0


def test_sharing_needs_room_for_the_prompt_rows():
    cache = filled(0)
    with pytest.raises(RuntimeError, match="allocate room"):
        cache.share_prompts(3)
