"""Session-wide test settings: offline hubs, quiet Ray, deterministic torch on 2 CPU threads."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# tests/ is the import root of the test packages: Ray workers need it to import test-only role
# classes (e.g. single_controller.toy_workers) by reference.
TESTS_DIR = __import__("pathlib").Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (STYLE.md: ray.init costs seconds here)."""
    import ray

    from hybridrl.single_controller import init_ray

    init_ray(num_cpus=2, extra_sys_path=[str(TESTS_DIR)])
    yield ray
    ray.shutdown()


@pytest.fixture()
def one_rank_env(monkeypatch):
    """The environment a launcher gives the only rank of a group (RANK, WORLD_SIZE, a free
    MASTER_PORT); the test initialises and destroys the group itself. torch's thread count, which
    joining a group may change, is restored."""
    from hybridrl.engine.distributed import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
