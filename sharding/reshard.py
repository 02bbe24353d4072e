"""Moving a set of weights from wherever it lives (the trainer's mesh, host memory) to the
serving engine's shardings and dtype: checked first, then copied device to device in chunks.

An update is all or nothing: a wrong tree, shape or dtype, or any NaN/Inf, raises
`WeightUpdateError` naming the tensor before a single byte is copied, so the caller keeps
serving the old weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.errors import UserError


class WeightUpdateError(UserError):
    pass


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def _in_host_memory(x) -> bool:
    return isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices()))


def finite(leaves) -> np.ndarray:
    """bool per leaf: no NaN or Inf in it. Arrays in host memory (numpy, CPU devices) are read
    where they are, by numpy, a block at a time (`_host_finite`); others in one compiled
    program on their devices. (Compiling that program took 0.65-1.0 s of a CPU run's start-up,
    on its critical path, for a check numpy makes in ~5 ms at 3M parameters and ~50 ms at
    30M.)"""
    if all(_in_host_memory(x) for x in leaves):
        out = np.empty(_BLOCK, bool)
        return np.array([_host_finite(np.asarray(x), out) for x in leaves], bool)
    return np.asarray(_all_finite(leaves))


_BLOCK = 1 << 18          # elements a host check reads at a time


def _host_finite(x: np.ndarray, out: np.ndarray) -> bool:
    """No NaN or Inf in `x`, read `_BLOCK` elements at a time into the reused `out`: no
    temporary the size of the weights (a quarter of a float32 model's bytes, in fresh pages)."""
    if np.issubdtype(x.dtype, np.integer) or x.dtype == bool:
        return True                                  # always finite
    flat = x.reshape(-1)
    for start in range(0, flat.size, _BLOCK):
        part = flat[start: start + _BLOCK]
        if not np.isfinite(part, out=out[:part.size]).all():
            return False
    return True


def missing_names(names, offered) -> list[str]:
    """The parameters of a model whose parameters are `names` that an update offering
    `offered` lacks. An update is every parameter, or exactly a LoRA model's adapters (names
    with `_lora_`: an adapter update, the base kept, serving/runner/engine.py `adapters_only`)."""
    offered = set(offered)
    adapters = [n for n in names if "_lora_" in n]
    whole = adapters if adapters and offered and offered <= set(adapters) else names
    return [n for n in whole if n not in offered]


def adapter_hint(names) -> str:
    """What to do about an update naming LoRA adapters (`names`: those the served model lacks)
    that the served model does not hold: nothing to add when there are none."""
    if not any("_lora_" in n for n in names):
        return ""
    return ("; LoRA adapters, which this server's model does not hold: start `jaxrl serve` "
            "with the trainer's model.lora as --lora-rank, --lora-alpha and --lora-targets")


def check_weights(params, target, *, pulled: bool = False
                  ) -> list[tuple[str, object, jax.ShapeDtypeStruct]]:
    """Validates `params` against `target` (ShapeDtypeStructs with shardings); returns
    (name, array, target) triples in tree order. `pulled`: a pull's arrays, which it has run
    `require_finite` on already (serving/weights/pulls.py)."""
    got = dict((_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0])
    want = [(_name(p), t) for p, t in jax.tree_util.tree_flatten_with_path(target)[0]]
    missing = [n for n, _ in want if n not in got]
    extra = sorted(set(got) - {n for n, _ in want})
    if missing or extra:
        raise WeightUpdateError(f"weight update does not match the served model: missing "
                                f"{missing[:3] or 'nothing'}, unexpected {extra[:3] or 'nothing'}"
                                f"{adapter_hint(extra)}")
    out = []
    for name, t in want:
        x = got[name]
        if tuple(x.shape) != tuple(t.shape):
            raise WeightUpdateError(f"weight update: {name} has shape {tuple(x.shape)}, the "
                                    f"served model needs {tuple(t.shape)}")
        quantized = np.dtype(t.dtype).itemsize == 1        # int8 or fp8, with a scale beside
        if quantized and x.dtype != t.dtype:
            raise WeightUpdateError(f"weight update: {name} has dtype {x.dtype}; the served "
                                    f"model holds it as {np.dtype(t.dtype).name} (quantized), "
                                    f"and takes it so")
        if not quantized and not (jnp.issubdtype(x.dtype, jnp.floating)
                                  and np.dtype(x.dtype).itemsize > 1):
            raise WeightUpdateError(f"weight update: {name} has dtype {x.dtype}; a floating "
                                    f"dtype of 16 or 32 bits is required")
        out.append((name, x, t))
    if not pulled:
        require_finite([(name, x) for name, x, _ in out])
    return out


def require_finite(named: list[tuple[str, object]]) -> None:
    """WeightUpdateError naming the first tensor of `named` (name, array) with a NaN or Inf."""
    ok = finite([x for _, x in named])
    if not ok.all():
        bad = [name for (name, _), good in zip(named, ok) if not good]
        raise WeightUpdateError(f"weight update rejected: {bad[0]} contains NaN or Inf"
                                + (f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""))


def reshard(params, target, *, chunk_bytes: int = 256 * 2**20, pulled: bool = False):
    """`params` placed and cast like `target` (checked first: `check_weights`). At most about
    `chunk_bytes` of new weights are in flight at a time, which bounds the extra device memory
    an update needs. `pulled`: the arrays a pull made for the caller (serving/weights/pulls.py),
    checked for NaN/Inf already and nobody else's, so placed where they lie when they already lie
    right, not copied."""
    checked = check_weights(params, target, pulled=pulled)
    placed, in_flight, size = [], [], 0
    for _, x, t in checked:
        if np.dtype(t.dtype).itemsize < np.dtype(x.dtype).itemsize and isinstance(x, jax.Array):
            x = x.astype(t.dtype)  # cast where the data is: fewer bytes to move
        # A jax array is copied (the trainer donates its parameters to the next step). A numpy
        # array XLA:CPU may take as it is, 64-byte aligned (whatever may_alias says, on the
        # pinned jax): its owner must not write into it while these weights serve, as the tcp
        # pull's receive pool does not (serving/weights/bulk.py).
        y = jax.device_put(x, t.sharding, may_alias=None if pulled else False).astype(t.dtype)
        placed.append(y)
        in_flight.append(y)
        size += y.nbytes
        if size >= chunk_bytes:
            jax.block_until_ready(in_flight)
            in_flight, size = [], 0
    jax.block_until_ready(in_flight)
    return jax.tree.unflatten(jax.tree.structure(target), placed)
