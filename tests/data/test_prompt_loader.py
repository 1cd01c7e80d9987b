"""Seeded shuffling and exact resume of the prompt loader (epochs included)."""

import pytest
from datafile_helpers import verl_row, write_parquet

from hybridrl.data import PromptDataLoader, ResumableBatchSampler, RLHFDataset


def _indices(loader_or_sampler, epochs):
    out = []
    for _ in range(epochs):
        for batch in loader_or_sampler:
            out.append(batch if isinstance(batch, list) else list(batch.non_tensor_batch["index"]))
    return out


def test_seeded_shuffle_is_deterministic_and_differs_by_epoch_and_seed():
    a = _indices(ResumableBatchSampler(20, 4, shuffle=True, seed=1), epochs=2)
    b = _indices(ResumableBatchSampler(20, 4, shuffle=True, seed=1), epochs=2)
    c = _indices(ResumableBatchSampler(20, 4, shuffle=True, seed=2), epochs=1)
    assert a == b and len(a) == 10
    assert sorted(i for batch in a[:5] for i in batch) == list(range(20))  # an epoch is a permutation
    assert a[:5] != a[5:] and a[:5] != c
    assert _indices(ResumableBatchSampler(5, 2, shuffle=False, drop_last=False), 1) == [[0, 1], [2, 3], [4]]
    assert _indices(ResumableBatchSampler(5, 2, shuffle=False, drop_last=True), 1) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 9])
def test_sampler_resume_matches_uninterrupted_run(stop_after):
    reference = _indices(ResumableBatchSampler(18, 4, seed=7), epochs=3)  # 4 batches an epoch, 2 rows dropped
    sampler = ResumableBatchSampler(18, 4, seed=7)
    taken = []
    while len(taken) < stop_after:
        for batch in sampler:
            taken.append(batch)
            if len(taken) == stop_after:
                break
    state = sampler.state_dict()
    resumed = ResumableBatchSampler(18, 4, seed=7)
    resumed.load_state_dict(state)
    assert state["epoch"] == stop_after // 4 and state["batch_in_epoch"] == stop_after % 4
    rest = []
    while len(taken) + len(rest) < len(reference):
        rest += list(resumed)
    assert taken + rest == reference


def test_resume_rejects_a_different_setup():
    state = ResumableBatchSampler(18, 4, seed=7).state_dict()
    with pytest.raises(ValueError, match="saved seed=7 but this run has 8"):
        ResumableBatchSampler(18, 4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="larger than the dataset"):
        ResumableBatchSampler(3, 4)


def test_loader_yields_dataproto_and_resumes(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [verl_row(f"{i}+1=", str(i + 1), i) for i in range(10)])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=16)
    loader = PromptDataLoader(ds, batch_size=3, seed=0)
    first = next(iter(loader))
    assert len(loader) == 3 and first.batch["input_ids"].shape == (3, 16)
    state = loader.state_dict()
    expected = [list(b.non_tensor_batch["index"]) for b in loader]  # the rest of epoch 0
    again = PromptDataLoader(ds, batch_size=3, seed=0)
    again.load_state_dict(state)
    assert [list(b.non_tensor_batch["index"]) for b in again] == expected


def _endless(loader):
    while True:
        yield from loader


def _same_batch(a, b):
    assert a.batch.keys() == b.batch.keys() and a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    assert all(a.batch[k].equal(b.batch[k]) for k in a.batch)
    assert all(list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k]) for k in a.non_tensor_batch)


def test_prefetch_makes_the_next_batch_without_moving_the_state(tmp_path, tokenizer):
    """Prefetching before every batch (across epochs, the last short batch included) hands out
    exactly the batches of a loader that never prefetches, and the saved state never moves."""
    path = write_parquet(tmp_path / "d.parquet", [verl_row(f"{i}+1=", str(i + 1), i) for i in range(10)])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=16)
    plain = _endless(PromptDataLoader(ds, batch_size=4, seed=3, drop_last=False))  # 3 batches an epoch
    loader = PromptDataLoader(ds, batch_size=4, seed=3, drop_last=False)
    ahead = _endless(loader)
    made = []
    loader.dataset = _Counting(ds, made)
    for step in range(7):
        state = loader.state_dict()
        loader.prefetch()
        loader.prefetch()  # a second prefetch of the same position makes nothing new
        assert loader.state_dict() == state
        assert len(made) == step + 1
        _same_batch(next(ahead), next(plain))
        assert len(made) == step + 1  # the batch handed out is the one made ahead


def test_a_prefetched_batch_is_not_handed_out_after_the_state_moved(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [verl_row(f"{i}+1=", str(i + 1), i) for i in range(10)])
    ds = RLHFDataset(path, tokenizer, max_prompt_length=16)
    loader = PromptDataLoader(ds, batch_size=3, seed=0)
    reference = [list(b.non_tensor_batch["index"]) for b in PromptDataLoader(ds, batch_size=3, seed=0)]
    loader.prefetch()  # batch 0 made ahead
    loader.load_state_dict({**loader.state_dict(), "batch_in_epoch": 2})  # e.g. a resume to batch 2
    assert [list(b.non_tensor_batch["index"]) for b in loader] == reference[2:]


class _Counting:
    """The dataset, recording each batch it makes."""

    def __init__(self, ds, made):
        self.ds, self.made = ds, made

    def __getitems__(self, items):
        self.made.append(list(items))
        return self.ds.__getitems__(items)

    def collate(self, items):
        return self.ds.collate(items)
