"""ResourcePool arithmetic and validation (no Ray needed until a Ray group acquires it)."""

import subprocess
import sys

import pytest

from hybridrl.single_controller import ResourcePool


def test_pool_from_trainer_counts_ranks_per_node():
    pool = ResourcePool.from_trainer(nnodes=2, n_gpus_per_node=4, use_gpu=True)
    assert pool.process_on_nodes == (4, 4) and pool.world_size == 8
    assert pool.bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert pool.actor_resources() == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_cpu_pool_reserves_a_cpu_fraction_and_shares_bundles():
    pool = ResourcePool([2], max_colocate_count=2)
    assert pool.bundle() == {"CPU": 0.1}
    assert pool.actor_resources() == {"num_cpus": 0.05, "num_gpus": 0.0}
    gpu = ResourcePool([1], use_gpu=True, num_cpus_per_worker=2, max_colocate_count=4)
    assert gpu.actor_resources() == {"num_cpus": 0.5, "num_gpus": 0.25}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"process_on_nodes": []}, "process_on_nodes must be positive"),
        ({"process_on_nodes": [2, 0]}, "process_on_nodes must be positive"),
        ({"process_on_nodes": [1], "max_colocate_count": 0}, "max_colocate_count must be >= 1"),
        ({"process_on_nodes": [1], "num_cpus_per_worker": 0}, "num_cpus_per_worker must be > 0"),
    ],
)
def test_pool_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResourcePool(**kwargs)


def test_importing_the_package_does_not_import_ray():
    code = "import sys, hybridrl.single_controller as sc; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
