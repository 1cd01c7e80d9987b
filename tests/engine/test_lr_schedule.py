"""LR schedules against hand-computed multipliers (verl's conventions)."""

import math

import pytest
import torch

from hybridrl.engine.lr_schedule import build_lr_scheduler


def _lrs(schedule, steps, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_lr_scheduler(opt, schedule, **kw)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_constant_with_warmup():
    assert _lrs("constant", 5, warmup_steps=2) == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert _lrs("constant", 2) == [2.0, 2.0]


def test_cosine_with_warmup_and_floor():
    lrs = _lrs("cosine", 7, warmup_steps=1, total_steps=5, min_lr_ratio=0.1)
    # step 0 warmup (0/1); then p = (s-1)/4: 0, .25, .5, .75, 1, and clamped at 1 after total_steps
    c = math.cos(math.pi / 4)
    expected = [0.0, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1, 0.1]
    assert lrs == pytest.approx([2.0 * e for e in expected], abs=1e-12)


def test_cosine_cycles():
    """verl's num_cycles: the cosine's argument is 2 pi num_cycles p; one whole cycle comes back up."""
    lrs = _lrs("cosine", 6, total_steps=4, min_lr_ratio=0.2, num_cycles=1.0)
    # p = s/4: 0, .25, .5, .75, 1, then clamped: cos(2 pi p) = 1, 0, -1, 0, 1, 1
    expected = [1.0, 0.6, 0.2, 0.6, 1.0, 1.0]
    assert lrs == pytest.approx([2.0 * e for e in expected], abs=1e-12)  # base lr 2
    assert _lrs("cosine", 3, total_steps=2, num_cycles=0.5) == pytest.approx(_lrs("cosine", 3, total_steps=2))


def test_schedule_arguments_are_validated():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="one of"):
        build_lr_scheduler(opt, "linear")
    with pytest.raises(ValueError, match="total_steps"):
        build_lr_scheduler(opt, "cosine", warmup_steps=3, total_steps=3)
    with pytest.raises(ValueError, match="num_cycles must be > 0, got 0"):
        build_lr_scheduler(opt, "cosine", total_steps=3, num_cycles=0)
