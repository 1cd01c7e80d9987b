"""The single controller: worker groups of Ray actors (or the driver process), dispatch, pools.

The driver runs the algorithm as plain Python and moves ``DataProto`` batches between worker
groups (HybridFlow, arXiv 2409.19256). See docs/single_controller.md. Importing this package does
not import Ray; the Ray backend is loaded when a group with ``backend="ray"`` is created.
"""

from hybridrl.single_controller.decorator import Dispatch, MethodSpec, register, registered_methods
from hybridrl.single_controller.dispatch import CallPlan, collect_results, plan_call
from hybridrl.single_controller.errors import WorkerDiedError, WorkerError
from hybridrl.single_controller.ray_utils import init_ray
from hybridrl.single_controller.resource_pool import ResourcePool
from hybridrl.single_controller.worker import RoleSpec, Worker, WorkerHost
from hybridrl.single_controller.worker_group import RemoteMethod, RoleProxy, WorkerFuture, WorkerGroup

__all__ = [
    "CallPlan",
    "Dispatch",
    "MethodSpec",
    "RemoteMethod",
    "ResourcePool",
    "RoleProxy",
    "RoleSpec",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFuture",
    "WorkerGroup",
    "WorkerHost",
    "collect_results",
    "init_ray",
    "plan_call",
    "register",
    "registered_methods",
]
