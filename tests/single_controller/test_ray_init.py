"""The options init_ray gives ray.init (ray.init itself replaced: what is under test is the call)."""

import ray

from hybridrl.single_controller import init_ray
from hybridrl.single_controller.ray_utils import INLINE_OBJECT_BYTES


def _options(monkeypatch, **kwargs):
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: seen.update(options))
    init_ray(**kwargs)
    return seen


def test_a_new_local_cluster_sends_a_ranks_batch_inline(monkeypatch):
    options = _options(monkeypatch, num_cpus=2)
    assert options["num_cpus"] == 2 and options["address"] is None
    assert options["_system_config"] == {"max_direct_call_object_size": INLINE_OBJECT_BYTES}
    assert INLINE_OBJECT_BYTES >= 1024 * 1024  # Ray's 100 KiB default sent the quickstart's batches to plasma


def test_joining_a_cluster_leaves_its_settings(monkeypatch):
    options = _options(monkeypatch, address="auto")
    assert "_system_config" not in options and "num_cpus" not in options


def test_the_caller_can_override_the_system_config(monkeypatch):
    options = _options(monkeypatch, _system_config={"max_direct_call_object_size": 1})
    assert options["_system_config"] == {"max_direct_call_object_size": 1}
