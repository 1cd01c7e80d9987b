import pickle

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto, to_object_array


def make(n=4):
    return DataProto.from_dict(
        tensors={"x": torch.arange(n * 3).view(n, 3).float(), "m": torch.ones(n, 2, dtype=torch.long)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra_info": [{"i": i} for i in range(n)]},
        meta_info={"temperature": 0.7},
    )


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        DataProto.from_dict({"a": torch.zeros(3, 1)}, {"b": ["x", "y"]})


def test_object_columns_keep_dicts_whole():
    d = make()
    assert d.non_tensor_batch["extra_info"].dtype == object
    assert d.non_tensor_batch["extra_info"][2] == {"i": 2}
    arr = to_object_array([[1, 2], [3]])
    assert arr.shape == (2,) and arr[0] == [1, 2]


def test_slice_index_mask():
    d = make(5)
    assert len(d[1:3]) == 2 and d[1:3].non_tensor_batch["uid"].tolist() == ["u1", "u2"]
    sub = d[torch.tensor([4, 0])]
    assert sub.batch["x"][0].tolist() == [12.0, 13.0, 14.0]
    assert sub.non_tensor_batch["uid"].tolist() == ["u4", "u0"]
    masked = d[np.array([True, False, True, False, False])]
    assert masked.non_tensor_batch["uid"].tolist() == ["u0", "u2"]
    assert len(d[-1]) == 1 and d[-1].non_tensor_batch["uid"][0] == "u4"
    with pytest.raises(IndexError):
        d[5]


def test_select_pop_union():
    d = make()
    s = d.select(["x"], ["uid"])
    assert set(s.keys()) == {"x", "uid"}
    with pytest.raises(KeyError, match="nope"):
        d.select(["nope"])
    popped = d.pop(batch_keys=["m"], meta_info_keys=["temperature"])
    assert "m" not in d.batch and "m" in popped.batch and popped.meta_info == {"temperature": 0.7}
    back = d.union(popped)
    assert torch.equal(back.batch["m"], popped.batch["m"])
    # identical values for the same key are fine, different ones raise
    d.union(d.select(["x"]))
    other = DataProto.from_dict({"x": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="'x'"):
        d.union(other)


def test_chunk_split_concat_roundtrip():
    d = make(6)
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    back = DataProto.concat(parts)
    assert torch.equal(back.batch["x"], d.batch["x"])
    assert back.non_tensor_batch["uid"].tolist() == d.non_tensor_batch["uid"].tolist()
    assert [len(p) for p in d.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        d.chunk(4)
    with pytest.raises(ValueError, match="columns"):
        DataProto.concat([d, d.select(["x"])])


def test_repeat_interleave_and_tile():
    d = make(2)
    assert d.repeat(2).non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert d.repeat(2, interleave=False).non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert torch.equal(d.repeat(3).batch["x"][:3], d.batch["x"][:1].expand(3, 3))


def test_reorder_and_pad_unpad():
    d = make(5)
    r = d.reorder([4, 3, 2, 1, 0])
    assert r.non_tensor_batch["uid"].tolist() == ["u4", "u3", "u2", "u1", "u0"]
    padded, pad = d.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert padded.non_tensor_batch["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    un = padded.unpad(pad)
    assert torch.equal(un.batch["x"], d.batch["x"])
    assert d.pad_to_divisor(5) == (d, 0)


def test_make_iterator_epochs_and_seed():
    d = make(8)
    a = [b.non_tensor_batch["uid"].tolist() for b in d.make_iterator(4, epochs=2, seed=1)]
    b = [b.non_tensor_batch["uid"].tolist() for b in d.make_iterator(4, epochs=2, seed=1)]
    assert a == b and len(a) == 4
    assert sorted(a[0] + a[1]) == sorted(d.non_tensor_batch["uid"].tolist())
    assert a[:2] != a[2:], "each epoch draws a fresh permutation"
    plain = [b.non_tensor_batch["uid"].tolist() for b in d.make_iterator(4, shuffle=False)]
    assert plain == [["u0", "u1", "u2", "u3"], ["u4", "u5", "u6", "u7"]]
    # the last mini-batch of a pass holds the rows left over (verl's split)
    assert [len(m) for m in d.make_iterator(3, epochs=2, seed=0)] == [3, 3, 2, 3, 3, 2]
    assert [b.non_tensor_batch["uid"].tolist() for b in d.make_iterator(3, shuffle=False)][-1] == ["u6", "u7"]
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1, got 0"):
        next(d.make_iterator(0))


def test_pickle_roundtrip_including_bf16():
    d = make()
    d.batch["h"] = torch.randn(4, 2).to(torch.bfloat16)
    back = pickle.loads(pickle.dumps(d, protocol=5))
    for k in d.batch:
        assert back.batch[k].dtype == d.batch[k].dtype and torch.equal(back.batch[k], d.batch[k])
    assert back.non_tensor_batch["extra_info"].tolist() == d.non_tensor_batch["extra_info"].tolist()
    assert back.meta_info == d.meta_info
    back.batch["x"] += 1  # tensors are writable after unpickling


def test_rename_and_repr():
    d = make()
    d.rename("x", "y")
    assert "y" in d and "x" not in d
    with pytest.raises(KeyError):
        d.rename("zzz", "q")
    assert "len=4" in repr(d)
