"""One Ray instance for the whole test session (init_ray is idempotent, so other test packages
that need Ray share it)."""

from pathlib import Path

import pytest

# tests/ is the import root of the test packages (no tests/__init__.py): the workers need it to
# import the role classes of the tests (e.g. single_controller.toy_workers) by reference.
TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from hybridrl.single_controller import init_ray

    init_ray(num_cpus=2, extra_sys_path=[str(TESTS_DIR)])
    yield ray
    ray.shutdown()
