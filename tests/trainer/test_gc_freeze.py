"""The trainer freezes the collector's survivors after warm-up and gives them back when it returns
(hybridrl.utils.gc_freeze)."""

from __future__ import annotations

import gc
import weakref

import pytest

from hybridrl.trainer.main_ppo import run
from hybridrl.utils import gc_freeze
from tests.trainer.e2e_helpers import all_finite, config, make_assets, read_metrics


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_objects_wait_for_release():
    node = Node()
    alive = weakref.ref(node)
    assert gc_freeze.freeze_survivors() >= 1
    del node
    gc.collect()
    assert alive() is not None  # frozen: the full collection did not walk it
    gc_freeze.release()
    gc.collect()
    assert alive() is None


def test_freeze_collects_garbage_first():
    node = Node()
    alive = weakref.ref(node)
    del node  # garbage before the freeze: collected, not frozen for good
    gc_freeze.freeze_survivors()
    assert alive() is None


def test_switched_off(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_GC_FREEZE", "0")
    assert gc_freeze.freeze_survivors() == 0
    assert gc.get_freeze_count() == 0


def test_release_leaves_objects_it_did_not_freeze():
    # followed through one object: the frozen count itself falls whenever another thread of this
    # process (Ray's, a scoring pool's) frees a frozen object, which made a count comparison flaky
    node = Node()
    alive = weakref.ref(node)
    gc_freeze.release()  # nothing of ours frozen
    gc.freeze()  # someone else's, the node among them
    gc_freeze.release()
    del node
    gc.collect()
    assert gc.get_freeze_count() > 0
    assert alive() is not None  # still frozen: release did not unfreeze what it had not frozen


def test_trainer_freezes_after_its_warmup_steps_and_releases(tmp_path, monkeypatch):
    frozen = []
    freeze = gc.freeze

    def counted():
        freeze()
        frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(gc, "freeze", counted)
    assets = make_assets(tmp_path / "assets")
    run(config(assets, tmp_path / "run", **{"trainer.backend": "local", "trainer.n_cpu_workers": 1,
                                            "trainer.total_training_steps": 3, "trainer.test_freq": -1,
                                            "trainer.val_before_train": False}))
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3] and all(all_finite(m) for m in metrics.values())
    # after steps 1 and 2 (not 3): the worker (in-process here) and the driver, each a collection
    assert len(frozen) == 2 * gc_freeze.WARMUP_STEPS and min(frozen) > 10_000
    assert gc.get_freeze_count() == 0  # released when fit returned
