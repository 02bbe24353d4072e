"""Layer projections held in 8 bits (`model.quantize=int8|fp8`): each of a layer's seven
projection matrices (q, k, v, o, gate, up, down; a mixture-of-experts model's experts stay as
they are) as 8-bit values with a float32 scale per output channel, `<name>_scale`, symmetric,
so the weight is q * scale: int8 (|w| / scale rounded, at most 127) or fp8 (float8_e4m3fn,
|w| / scale at most 448, the e4m3 format's largest, as the FP8 recipes of vLLM and verl). Half
a bfloat16 matrix's bytes, a quarter of a float32 one's.

The weights are frozen: a quantized model trains LoRA adapters on top (QLoRA's recipe with
int8 for its NF4) and is served as it is. Each layer's weights are dequantized to the compute
dtype where the layer reads them (`layer_weights`), one layer at a time inside the layer scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (input axes, output axes) of each matrix, after any leading layer axis: [.., in.., out..].
_AXES = {"q_proj": (1, 2), "k_proj": (1, 2), "v_proj": (1, 2), "o_proj": (2, 1),
         "gate_proj": (1, 1), "up_proj": (1, 1), "down_proj": (1, 1)}
SCALE = "_scale"
# model.quantize -> (the values' dtype, the largest magnitude a value takes)
FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
QMAX = FORMATS["int8"][1]


def _input_axes(ndim: int, name: str) -> tuple[int, ...]:
    n_in, n_out = _AXES[name]
    return tuple(range(ndim - n_out - n_in, ndim - n_out))


def enabled(cfg) -> bool:
    return cfg.quantize in FORMATS


def names(cfg) -> tuple[str, ...]:
    """The projections `cfg` holds in 8 bits (none unless model.quantize is int8 or fp8)."""
    if not enabled(cfg):
        return ()
    return QUANTIZED[:4] if cfg.num_experts else QUANTIZED


def quantize(w, name: str, kind: str = "int8"):
    """(8-bit values of format `kind`, float32 scale per output channel) of matrices
    w [.., in.., out..]."""
    dtype, qmax = FORMATS[kind]
    axes = _input_axes(w.ndim, name)
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=axes) / qmax
    scale = jnp.where(scale > 0, scale, 1.0)
    q = w / jnp.expand_dims(scale, axes)
    if kind == "int8":
        q = jnp.round(q)
    return jnp.clip(q, -qmax, qmax).astype(dtype), scale


def dequantize(q, scale, dtype, name: str):
    """q * scale in `dtype`, the scale broadcast over the input axes."""
    scale = jnp.expand_dims(scale.astype(dtype), _input_axes(q.ndim, name))
    return q.astype(dtype) * scale


def layer_weights(cfg, p: dict, keep=()) -> dict:
    """One layer's (or the stack's) parameters `p` in the compute dtype, int8 projections
    dequantized and their scales dropped; entries named in `keep` as they are."""
    dt = cfg.compute_dtype
    out = {}
    for k, v in p.items():
        if k in keep:
            out[k] = v
        elif k.endswith(SCALE):
            continue
        elif f"{k}{SCALE}" in p:
            out[k] = dequantize(v, p[f"{k}{SCALE}"], dt, k)
        else:
            out[k] = v.astype(dt)
    return out


def quantized(params: dict, cfg) -> dict:
    """`params` (a model's tree) with its projections int8 and their scales beside them, as
    model config `cfg` holds them; a tree already quantized is returned as it is."""
    layers = dict(params["layers"])
    for name in names(cfg):
        if f"{name}{SCALE}" not in layers:
            layers[name], layers[f"{name}{SCALE}"] = quantize(layers[name], name, cfg.quantize)
    return {**params, "layers": layers}


def dequantized(params: dict, cfg) -> dict:
    """`params` with every int8 projection as q * scale in `cfg`'s weight dtype (no scales)."""
    layers = dict(params["layers"])
    for name in list(layers):
        if f"{name}{SCALE}" in layers:
            layers[name] = dequantize(layers[name], layers.pop(f"{name}{SCALE}"),
                                      cfg.weight_dtype, name)
    return {**params, "layers": layers}


def as_float(target: dict, cfg) -> dict:
    """ShapeDtypeStructs of a quantized model's parameter tree `target` as its unquantized
    model holds them (the projections in `cfg`'s weight dtype, no scales), same shardings."""
    layers = {}
    for k, v in target["layers"].items():
        if k.endswith(SCALE):
            continue
        if f"{k}{SCALE}" in target["layers"]:
            v = jax.ShapeDtypeStruct(v.shape, cfg.weight_dtype, sharding=v.sharding)
        layers[k] = v
    return {**target, "layers": layers}
