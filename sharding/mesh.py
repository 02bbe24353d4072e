"""Device meshes and the one place where logical axis names become mesh placements.

Model code names axes (`batch`, `embed`, `q_heads`, `mlp`, `vocab`, `layers`, ...). `RULES` maps
each to mesh axes, MaxText-style; `logical_to_sharding` turns a parameter's names into a
`NamedSharding`, and `init_sharded` creates parameters already in place (jit with
`out_shardings`), so a model is never whole on one device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "stage", "fsdp", "expert", "context", "tensor")

# logical axis -> mesh axes it is split over, in order. Unlisted axes are replicated.
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    # Parameters are split over the context axis too (its devices share rows, not weights:
    # ZeRO-3 over fsdp x context, as MaxText shards `embed`), gathered layer by layer.
    "embed": ("fsdp", "context"),
    "vocab": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "layers": ("stage",),
    # Mixture-of-experts weights [L, E, D, F]: the experts split over `expert` (expert
    # parallelism: each shard runs its own experts on the tokens the others send it, all-to-all,
    # jaxrl/models/moe_parallel.py) and then fsdp (each fsdp shard stores a part of them whole,
    # gathered by XLA; embed, after them, stays unsplit), their hidden size over tensor.
    "experts": ("expert", "fsdp"),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; their product is the device count. One axis may be -1: all the
    devices the others leave."""

    data: int = 1     # pure data parallelism (replicated parameters)
    stage: int = 1    # pipeline stages (the `layers` axis is split over it)
    fsdp: int = -1    # data parallelism with parameters and optimizer state sharded (ZeRO-3)
    # Expert parallelism for mixture-of-experts models: the experts split over it, tokens sent
    # to their experts' devices and back (all-to-all); the rest of the model takes it as data
    # parallelism.
    expert: int = 1
    # Context parallelism: every row's tokens split over it (two chunks a device, balanced for
    # the causal mask), attention across it by all-gathered keys and values
    # (jaxrl/models/context_attention.py); the rest of the model runs token by token.
    context: int = 1
    tensor: int = 1   # tensor parallelism over heads, mlp and vocab

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        bad = {k: v for k, v in sizes.items() if v != -1 and v < 1}
        if bad:
            raise ValueError(f"mesh sizes must be >= 1 or -1, got {bad}")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {sizes}")

    def resolve(self, num_devices: int) -> dict[str, int]:
        sizes = dataclasses.asdict(self)
        fixed = math.prod(v for v in sizes.values() if v != -1)
        auto = [k for k, v in sizes.items() if v == -1]
        if auto:
            if num_devices % fixed:
                raise ValueError(f"mesh {sizes}: the fixed axes use {fixed} devices, which does "
                                 f"not divide the {num_devices} available")
            sizes[auto[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(f"mesh {sizes} needs {fixed} devices, but {num_devices} are given")
        return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, stage, fsdp, expert, context, tensor) over `devices` (default:
    all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if len(devices) == len(jax.devices()):
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices)
    else:  # a subset (split placement): keep the given order
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: dict[str, tuple[str, ...]] = RULES) -> P:
    """PartitionSpec for a tensor whose dimensions have logical names `axes`.

    Mesh axes of size 1, mesh axes already used by an earlier dimension, and mesh axes that do
    not divide the dimension are left out, so every tensor gets an even, legal placement (e.g.
    two kv heads on a tensor=4 mesh stay replicated).
    """
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        chosen = []
        for ax in rules.get(name, ()) if name else ():
            size = mesh.shape[ax]
            if size == 1 or ax in used:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size) == 0:
                chosen.append(ax)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def logical_to_sharding(axes, shape, mesh: Mesh, rules=RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def tree_shardings(axes_tree, abstract_tree, mesh: Mesh, rules=RULES):
    """NamedShardings for a tree of arrays given a matching tree of logical axis tuples."""
    return jax.tree.map(lambda axes, a: logical_to_sharding(axes, a.shape, mesh, rules),
                        axes_tree, abstract_tree, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int, rules=RULES, leading: int = 0) -> NamedSharding:
    """Sharding of a batch array: dimension `leading` over the batch axes, the rest replicated."""
    batch_axes = tuple(a for a in rules["batch"] if mesh.shape[a] > 1)
    spec = [None] * ndim
    spec[leading] = batch_axes or None
    return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def init_sharded(init_fn: Callable[[], dict], shardings):
    """Runs `init_fn` under jit with `out_shardings`: each device computes only its shard."""
    return jax.jit(init_fn, out_shardings=shardings)()


def data_parallel_size(mesh: Mesh, rules=RULES) -> int:
    return math.prod(mesh.shape[a] for a in rules["batch"])
