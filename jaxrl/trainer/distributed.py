"""Multi-host start-up: one `jaxrl train` program per host on JAX's distributed runtime.

Explicit (any cluster, and two processes on one machine for tests):
    jaxrl train --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 ...
Detected, as MaxText does, by `jax.distributed.initialize()` itself: a multi-host Cloud TPU
slice (TPU VM metadata), SLURM (`srun`: SLURM_* variables), GKE (JobSet / Kubernetes indexed
jobs), Open MPI. A single host with none of these starts no runtime at all.

On CPU the collectives between processes go through gloo. Every process runs the same program
over the global mesh and reads only its own share of each batch (sharding/hosts.py); Orbax
checkpoints are written by all of them together; metrics, plots, the console and the RL actor
are process 0's.
"""

from __future__ import annotations

import os

import jax

from jaxrl.errors import UserError

# Environment variables that say a cluster launched several processes of this program.
_CLUSTER_HINTS = {
    "SLURM_NTASKS": lambda v: int(v) > 1,          # srun with more than one task
    "TPU_WORKER_HOSTNAMES": lambda v: "," in v,    # a multi-host TPU slice
    "MEGASCALE_NUM_SLICES": lambda v: int(v) > 1,  # multi-slice TPU
    "JOBSET_NAME": lambda v: bool(v),              # GKE JobSet
    "OMPI_COMM_WORLD_SIZE": lambda v: int(v) > 1,  # mpirun
}


def cluster_detected(environ=os.environ) -> str | None:
    """The variable that shows a multi-process launch, or None."""
    for name, test in _CLUSTER_HINTS.items():
        value = environ.get(name)
        try:
            if value is not None and test(value):
                return name
        except ValueError:
            continue
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Starts the distributed runtime when asked (the three arguments together) or when a
    cluster launch is detected; returns whether it did. Call before anything touches a device."""
    explicit = (coordinator, num_processes, process_id)
    if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
        raise UserError("--coordinator, --num-processes and --process-id go together: give "
                        "all three or none")
    if coordinator is not None:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UserError(f"--process-id {process_id} must be in [0, --num-processes "
                            f"{num_processes})")
        host, sep, port = coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UserError(f"--coordinator {coordinator!r} is not HOST:PORT")
        if num_processes == 1:
            return False
    elif cluster_detected() is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU devices only
    if coordinator is not None:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id)
    else:
        jax.distributed.initialize()
    return True


def is_leader() -> bool:
    """Process 0: the one that logs, plots and runs the RL actor."""
    return jax.process_index() == 0
