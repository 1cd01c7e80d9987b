"""StaticKVCache's row bookkeeping: repeated rows, a shared prompt store, compaction."""

from __future__ import annotations

import pytest
import torch

from hybridrl.rollout.kv_cache import StaticKVCache


def filled(prompt_length: int) -> StaticKVCache:
    """2 prompts of 3 slots (prompt 1 left-padded by one), room for 3 samples each and 2 new slots."""
    cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cache.allocate(2, 6, 5, torch.device("cpu"), prompt_length=prompt_length)
    keys = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)
    for layer in range(2):
        cache.write(layer, 0, keys + 100 * layer, -(keys + 100 * layer))
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 0] = False
    cache.prompt_valid()[:, :3] = mask
    cache.length = 3
    return cache


def test_shared_prompts_are_stored_once_and_read_by_every_sample():
    copies, shared = filled(0), filled(3)
    copies.repeat_rows(3)
    shared.share_prompts(3)
    assert shared.shared == 3 and shared.rows == copies.rows == 6
    assert shared.source.tolist() == [0, 0, 0, 1, 1, 1]
    # the live rows hold only the 2 response slots: 2 x 3 prompt slots + 6 x 2 instead of 6 x 5
    assert shared.buffer.shape[4] == 2 and shared.prompt_store.shape[2:5] == (2, 2, 3)
    for layer in range(2):
        keys, values = copies.layer(layer)
        prompt_keys, prompt_values = shared.prompts(layer)
        # what each sample reads for its prompt slots is its copy's content
        assert torch.equal(prompt_keys[shared.source], keys[:6, :, :3])
        assert torch.equal(prompt_values[shared.source], values[:6, :, :3])
    assert torch.equal(shared.valid[:6], copies.valid[:6])
    assert shared.attention_mask().shape == (6, 1, 1, 3) and not shared.attention_mask()[3:, 0, 0, 0].any()
    assert copies.prompts(0) is None
    with pytest.raises(RuntimeError, match="share their prompts"):
        shared.view(0)


def test_compaction_moves_live_rows_and_their_prompt_pointers():
    cache = filled(3)
    cache.share_prompts(3)
    store = cache.prompt_store.clone()
    for layer in range(2):  # each live row's first new slot (slot 3, index 0 of its own slots)
        keys, values = cache.layer(layer)
        keys[:6, :, 0] = torch.arange(6, dtype=torch.float32).view(6, 1, 1) + 10 * layer
        values[:6, :, 0] = -keys[:6, :, 0]
    cache.length = 4
    cache.select(torch.tensor([1, 4, 5]))
    assert cache.rows == 3 and cache.source.tolist() == [0, 1, 1]
    keys, values = cache.layer(1)
    assert keys[:3, 0, 0, 0].tolist() == [11.0, 14.0, 15.0] and values[:3, 1, 0, 0].tolist() == [-11.0, -14.0, -15.0]
    assert cache.valid[:3, 0].tolist() == [True, False, False]  # rows of prompt 1 keep its padding
    assert torch.equal(cache.prompt_store, store)
    cache.free()
    assert cache.buffer is None and cache.source is None and cache.prompt_store is None


def test_sharing_needs_a_prefilled_prompt_store():
    cache = filled(0)
    with pytest.raises(RuntimeError, match="prompt length"):
        cache.share_prompts(3)
