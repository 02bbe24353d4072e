"""Arrays that span several processes (one per host): which part of a global array this
process holds, and building the global array from that part alone.

With one process these reduce to a `device_put` of the whole array. With several (on
`jax.distributed`), each process loads only the rows its devices hold and
`jax.make_array_from_process_local_data` puts the pieces together, so no host ever holds, or
reads, the whole global batch.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def local_box(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The smallest box of `shape` holding every element this process's devices hold. With
    devices in process-major order (jax.devices(), as make_mesh uses them) it holds nothing
    else, which is checked."""
    distinct = {tuple(index.indices(size)[:2] for index, size in zip(b, shape))
                for b in sharding.addressable_devices_indices_map(shape).values()}
    box = tuple(slice(min(b[d][0] for b in distinct), max(b[d][1] for b in distinct))
                for d in range(len(shape)))
    held = sum(int(np.prod([stop - start for start, stop in b])) for b in distinct)
    volume = int(np.prod([s.stop - s.start for s in box]))
    if held != volume:
        raise ValueError(f"this process's devices hold {held} elements of a {shape} array "
                         f"spread over a {volume}-element box: the mesh is not in process-major "
                         f"device order")
    return tuple(box)


def global_array(local, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The global `shape` array of which this process holds `local` (its `local_box`)."""
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), shape)


def global_batch(local: dict, sharding: NamedSharding, shapes: dict) -> dict:
    """`global_array` for every array of a batch dict, each with its global shape."""
    return {k: global_array(v, sharding, shapes[k]) for k, v in local.items()}


def fully_addressable(tree):
    """`tree` with every array whole on this process (gathered from all processes when it
    spans several; as it is otherwise), e.g. to evaluate on one host's devices."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
