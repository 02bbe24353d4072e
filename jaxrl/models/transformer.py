"""The decoder-only transformer (Flax NNX): GQA, RoPE, RMSNorm, a gated MLP, a scanned layer stack;
Gemma's sandwich norms, soft-caps and sliding-window layers where the config asks for them.

Shape letters: B batch, T length, D embed, N query heads, G key/value heads, H head dim,
F mlp hidden, V vocab, L layers. Every parameter carries logical axis names in its `axes`
metadata (`vocab`, `embed`, `q_heads`, `kv_heads`, `head_dim`, `mlp`, `norm`, `layers`);
only `sharding/` maps them to a mesh.
"""

from __future__ import annotations

import math

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import layers as ops
from jaxrl.models import lora, quant
from jaxrl.models.config import ModelConfig
from jaxrl.models.layer_parts import attend, attention_inputs, attention_output_and_mlp, norm
from jaxrl.models.moe import router_load, routing_mismatch

_normal = nnx.initializers.normal(stddev=0.02)


def _param(rngs, shape, axes, dtype, init="normal"):
    if init == "normal":
        value = _normal(rngs.params(), shape, dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    return nnx.Param(value, axes=axes)


class Layers(nnx.Module):
    """All decoder layers; each parameter is stacked on a leading `layers` axis so that the whole
    stack runs as one `lax.scan` and compile time does not grow with depth."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, D, N, G, H, F = (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, cfg.mlp_dim)
        dt = cfg.weight_dtype
        norm = "zeros" if cfg.gemma else "ones"      # Gemma's norms multiply by (1 + w)
        self.attn_norm = _param(rngs, (L, D), ("layers", "norm"), dt, norm)
        self.q_proj = _param(rngs, (L, D, N, H), ("layers", "embed", "q_heads", "head_dim"), dt)
        self.k_proj = _param(rngs, (L, D, G, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        self.v_proj = _param(rngs, (L, D, G, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
        self.o_proj = _param(rngs, (L, N, H, D), ("layers", "q_heads", "head_dim", "embed"), dt)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (L, N, H), ("layers", "q_heads", "head_dim"), dt, "zeros")
            self.k_bias = _param(rngs, (L, G, H), ("layers", "kv_heads", "head_dim"), dt, "zeros")
            self.v_bias = _param(rngs, (L, G, H), ("layers", "kv_heads", "head_dim"), dt, "zeros")
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (L, H), ("layers", "norm"), dt, norm)
            self.k_norm = _param(rngs, (L, H), ("layers", "norm"), dt, norm)
        if cfg.gemma:    # sandwich norms: on the attention's and the MLP's outputs too
            self.post_attn_norm = _param(rngs, (L, D), ("layers", "norm"), dt, norm)
            self.post_mlp_norm = _param(rngs, (L, D), ("layers", "norm"), dt, norm)
        self.mlp_norm = _param(rngs, (L, D), ("layers", "norm"), dt, norm)
        if cfg.num_experts:
            E, F = cfg.num_experts, cfg.moe_mlp_dim
            self.router = _param(rngs, (L, D, E), ("layers", "embed", "experts"), dt)
            axes = ("layers", "experts", "embed", "mlp")
            self.experts_gate = _param(rngs, (L, E, D, F), axes, dt)
            self.experts_up = _param(rngs, (L, E, D, F), axes, dt)
            self.experts_down = _param(rngs, (L, E, F, D), ("layers", "experts", "mlp", "embed"),
                                       dt)
            return
        self.gate_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.up_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
        self.down_proj = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt)

    def quantize(self, cfg: ModelConfig):
        """The projections in 8 bits with a scale per output channel (jaxrl/models/quant.py),
        the scale sharded as the matrix's output axes."""
        for name in quant.names(cfg):
            param = getattr(self, name)
            axes = param.get_metadata()["axes"]
            q, scale = quant.quantize(param[...], name, cfg.quantize)
            n_out = scale.ndim - 1
            setattr(self, name, nnx.Param(q, axes=axes))
            setattr(self, name + quant.SCALE, nnx.Param(scale, axes=("layers", *axes[-n_out:])))

    def add_adapters(self, cfg: ModelConfig, rngs: nnx.Rngs):
        """LoRA's A and B for each targeted projection (jaxrl/models/lora.py), float32. Drawn
        after every base parameter, so a model with adapters has the base weights of the same
        seed without them."""
        for name, (shape, axes) in lora.adapter_shapes(cfg).items():
            setattr(self, name, nnx.Param(lora.init_adapter(rngs.params(), name, shape),
                                          axes=axes))

    def stacked(self) -> dict[str, jax.Array]:
        """The parameters as plain arrays, each with the leading `layers` axis."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


# Keys a caller may add to a MoE model's per-layer parameters (`Transformer.hidden_aux`'s
# `engine_experts`): the experts the engine chose for each token [B, T, K], compared with the
# router's own (ENGINE_EXPERTS), or compared and used instead (REPLAY_EXPERTS).
ENGINE_EXPERTS, REPLAY_EXPERTS = "engine_experts", "replay_experts"


def _has_aux(cfg: ModelConfig, p: dict) -> bool:
    """Whether a layer returns (x, aux) rather than x: a MoE layer given the engine's experts
    (aux["mismatch"]: whether each token's experts differ [B, T]) or training with the
    load-balancing loss (aux: moe.router_load's counts)."""
    return ENGINE_EXPERTS in p or REPLAY_EXPERTS in p or bool(cfg.router_aux_loss_coef)


def decoder_layer(cfg: ModelConfig, p: dict, x_BTD, cos_BTH, sin_BTH, mask_BTS,
                  segment_ids_BT=None):
    """One pre-norm decoder layer; `p` holds that layer's parameters (no `layers` axis)."""
    engine_BTK = p.get(ENGINE_EXPERTS, p.get(REPLAY_EXPERTS))
    w = quant.layer_weights(cfg, {k: v for k, v in p.items()
                                  if k not in (ENGINE_EXPERTS, REPLAY_EXPERTS)},
                            keep=(lora.DROPOUT_KEY, lora.ROWS))
    q_BTNH, k_BTGH, v_BTGH = attention_inputs(cfg, w, x_BTD, cos_BTH, sin_BTH)
    # Names a remat policy can save, offload or recompute (sharding/offload.py).
    q_BTNH = checkpoint_name(q_BTNH, "query_proj")
    k_BTGH = checkpoint_name(k_BTGH, "key_proj")
    v_BTGH = checkpoint_name(v_BTGH, "value_proj")
    a_BTNH = checkpoint_name(attend(cfg, q_BTNH, k_BTGH, v_BTGH, mask_BTS, segment_ids_BT),
                             "attention_out")
    x_BTD, routing = attention_output_and_mlp(cfg, w, x_BTD, a_BTNH, p.get(REPLAY_EXPERTS))
    if not _has_aux(cfg, p):
        return x_BTD
    aux = {}
    if engine_BTK is not None:
        aux["mismatch"] = routing_mismatch(routing[0], engine_BTK)
    if cfg.router_aux_loss_coef:
        valid_BT = (jnp.ones(x_BTD.shape[:2], bool) if segment_ids_BT is None
                    else segment_ids_BT > 0)
        aux.update(router_load(*routing, valid_BT))
    return x_BTD, aux


def layer_inputs(cfg: ModelConfig, positions_BT, segment_ids_BT, length: int):
    """A function of a layer's `sliding` flag (a traced bool) to what that layer needs beside
    its weights: (cos, sin, mask). Full-attention layers get the causal (per-segment) mask and
    the global RoPE; sliding-window layers that mask cut to the window and their own RoPE base
    (Gemma 3). A model whose layers are all alike ignores the flag."""
    full = (*ops.rope_tables(cfg, positions_BT), ops.causal_mask(segment_ids_BT, length))
    sliding = cfg.sliding_layers()
    if not any(sliding):
        return lambda _: full
    local = (*ops.rope_tables(cfg, positions_BT, local=True),
             full[2] & ops.window_mask(positions_BT, positions_BT, cfg.sliding_window))
    if all(sliding):
        return lambda _: local
    return lambda s: jax.tree.map(lambda g, l: jnp.where(s, l, g), full, local)


def _check_layers_alike(cfg: ModelConfig) -> None:
    if len(set(cfg.sliding_layers())) > 1:
        raise ValueError("pipeline stages run a slice of the layers without their indices, so "
                         "they cannot run a model that mixes sliding-window and full-attention "
                         f"layers (model.family={cfg.family}); train it without a pipeline")


def apply_layer(cfg: ModelConfig, p: dict, x_BTD, positions_BT, segment_ids_BT=None,
                layer_fn=None):
    """One layer (`p` without the `layers` axis) and no loop: what a pipeline stage program
    runs per layer, and what zero-bubble's backward split traces (sharding/split_backward.py).
    `layer_fn` as in `run_layers`. The layer does not know its index, so the model's layers
    must all be alike (no mix of sliding-window and full-attention layers)."""
    _check_layers_alike(cfg)
    if cfg.router_aux_loss_coef:
        raise ValueError(f"model.router_aux_loss_coef={cfg.router_aux_loss_coef}: the "
                         f"load-balancing loss is not computed inside pipeline stages; train "
                         f"without a pipeline or set it to 0")
    cos_BTH, sin_BTH, mask_BTS = layer_inputs(cfg, positions_BT, segment_ids_BT,
                                              x_BTD.shape[1])(None)
    return (layer_fn or decoder_layer)(cfg, p, x_BTD, cos_BTH, sin_BTH, mask_BTS,
                                       segment_ids_BT)


def run_layers(cfg: ModelConfig, stacked: dict, x_BTD, positions_BT, segment_ids_BT=None,
               layer_fn=None):
    """Runs the layers stacked in `stacked` (each parameter with a leading `layers` axis, any
    number of layers) over x [B, T, D] as one `lax.scan`, unrolled or not (`layer_unroll`).
    `layer_fn` (default `decoder_layer`) lets sharding/ wrap each layer in a remat or offload
    policy. `stacked` holds the model's layers from the first (a pipeline stage's slice of a
    model whose layers are all alike may hold any)."""
    inputs = layer_inputs(cfg, positions_BT, segment_ids_BT, x_BTD.shape[1])
    layer_fn = layer_fn or decoder_layer
    # Layers that return aux (`_has_aux`): (x, aux with a leading layer axis) is returned.
    routed = _has_aux(cfg, stacked)

    def step(x, p, sliding):
        out = layer_fn(cfg, p, x, *inputs(sliding), segment_ids_BT)
        return out if routed else (out, None)

    if len(set(cfg.sliding_layers())) == 1:      # layers all alike: nothing to tell apart
        x_BTD, ys = jax.lax.scan(lambda x, p: step(x, p, None), x_BTD, stacked,
                                 unroll=layer_unroll(cfg))
        return (x_BTD, ys) if routed else x_BTD
    if jax.tree.leaves(stacked)[0].shape[0] != cfg.num_layers:
        _check_layers_alike(cfg)                 # a stage's slice: raises
    sliding_L = jnp.asarray(cfg.sliding_layers())
    x_BTD, ys = jax.lax.scan(lambda x, xs: step(x, *xs), x_BTD, (stacked, sliding_L),
                             unroll=layer_unroll(cfg))
    return (x_BTD, ys) if routed else x_BTD


def layer_unroll(cfg: ModelConfig) -> bool:
    """Whether the layer scan is unrolled: model.scan_layers=unroll, or auto once the trainer
    has resolved it for CPU devices (`ModelConfig.for_platform`); unresolved, it scans."""
    return cfg.scan_layers == "unroll"


_NO_WINDOW = 2**30    # a full-attention layer's window in `extend`: longer than any sequence


def _cached_layer_inputs(cfg: ModelConfig, positions_BT):
    """`layer_inputs` for `extend`: a layer's `sliding` flag to (cos, sin, window), the window
    (None: no layer slides) for the KV cache's `attend`, which builds the mask itself."""
    full = ops.rope_tables(cfg, positions_BT)
    sliding = cfg.sliding_layers()
    if not any(sliding):
        return lambda _: (*full, None)
    local = ops.rope_tables(cfg, positions_BT, local=True)
    if all(sliding):
        return lambda _: (*local, cfg.sliding_window)
    return lambda s: (*jax.tree.map(lambda g, l: jnp.where(s, l, g), full, local),
                      jnp.where(s, cfg.sliding_window, _NO_WINDOW))


class Transformer(nnx.Module):
    """`model(input_ids_BT)` -> float32 logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.weight_dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dt)
        self.layers = Layers(cfg, rngs=rngs)
        self.final_norm = _param(rngs, (cfg.embed_dim,), ("norm",), dt, "ones")
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), dt)
        self.layers.quantize(cfg)
        self.layers.add_adapters(cfg, rngs)

    def hidden(self, input_ids_BT, positions_BT=None, segment_ids_BT=None, stack_fn=None):
        """Final normalised hidden states [B, T, D]. `segment_ids_BT` confines attention to
        packed segments; `stack_fn` (default `run_layers`) runs the layer stack and lets
        sharding/ wrap it in a remat policy or a pipeline schedule."""
        cfg = self.cfg
        b, t = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x_BTD = self.embed_tokens(input_ids_BT)
        x_BTD = (stack_fn or run_layers)(cfg, self.layers.stacked(), x_BTD, positions_BT,
                                         segment_ids_BT)
        if _has_aux(cfg, {}):        # the load-balancing counts: see hidden_aux
            x_BTD = x_BTD[0]
        return self.final_hidden(x_BTD)

    def hidden_aux(self, input_ids_BT, positions_BT=None, segment_ids_BT=None, stack_fn=None,
                   engine_experts_BTLK=None, replay: bool = False):
        """`hidden` of a MoE model and what its layers report, each with a leading layer axis:
        given the experts the engine chose for each token in each layer ([B, T, L, K], -1
        where unknown), `mismatch` (whether each token's experts differ from them [L, B, T]);
        with model.router_aux_loss_coef, moe.router_load's counts. `replay`: the layers use
        the engine's experts (where known) instead of their routers' choice."""
        cfg = self.cfg
        if not cfg.num_experts:
            raise ValueError("hidden_aux needs a mixture-of-experts model "
                             f"(model.family={cfg.family} has no experts)")
        b, t = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        stacked = self.layers.stacked()
        if engine_experts_BTLK is not None:
            key = REPLAY_EXPERTS if replay else ENGINE_EXPERTS
            stacked = {**stacked, key: jnp.moveaxis(engine_experts_BTLK, 2, 0)}
        if not _has_aux(cfg, stacked):
            return self.hidden(input_ids_BT, positions_BT, segment_ids_BT, stack_fn), {}
        x_BTD, aux_L = (stack_fn or run_layers)(
            cfg, stacked, self.embed_tokens(input_ids_BT), positions_BT, segment_ids_BT)
        return self.final_hidden(x_BTD), aux_L

    def embed_tokens(self, input_ids_BT):
        cfg = self.cfg
        x_BTD = jnp.take(self.embed[...], input_ids_BT, axis=0).astype(cfg.compute_dtype)
        if cfg.gemma:    # the scale rounded to the compute dtype first, as Hugging Face does
            x_BTD = x_BTD * jnp.asarray(math.sqrt(cfg.embed_dim), cfg.compute_dtype)
        return x_BTD

    def final_hidden(self, x_BTD):
        cfg = self.cfg
        return norm(cfg, x_BTD, self.final_norm[...].astype(cfg.compute_dtype))

    def extend(self, input_ids_BT, start_B, cache, valid_B=None, routes: bool = False,
               adapters_B=None):
        """Runs T new tokens per row on top of a KV cache: row b's tokens sit at positions
        start_B[b] .. start_B[b]+T-1, attend to what the cache holds before them and causally
        to each other, and their keys and values are written into it. Only the first
        valid_B[b] tokens of row b are real (default: all); the rest are padding and are not
        stored. One mechanism for prefill, chunked prefill (T = chunk) and decode (T = 1), on
        any cache of jaxrl.models.kv_cache's protocol (contiguous, or serving's paged pool).
        Returns (final hidden states [B, T, D], cache), and with `routes` (a MoE model) the
        experts each token was routed to in each layer [B, T, L, K] after them. `adapters_B`:
        each row's LoRA adapter where the model holds several (lora.adapters > 1)."""
        cfg = self.cfg
        b, t = input_ids_BT.shape
        offsets_T = jnp.arange(t, dtype=start_B.dtype)
        positions_BT = start_B[:, None] + offsets_T[None, :]
        valid_BT = None if valid_B is None else offsets_T[None, :] < valid_B[:, None]
        inputs = _cached_layer_inputs(cfg, positions_BT)
        sliding_L = jnp.asarray(cfg.sliding_layers())
        x_BTD = self.embed_tokens(input_ids_BT)

        def body(carry, xs):
            x_BTD, cache = carry
            p, layer = xs
            w = quant.layer_weights(cfg, p)
            if adapters_B is not None:         # each row's LoRA adapter (lora.adapters > 1)
                w = {**w, lora.ROWS: adapters_B}
            cos_BTH, sin_BTH, window = inputs(sliding_L[layer])
            q_BTNH, k_BTGH, v_BTGH = attention_inputs(cfg, w, x_BTD, cos_BTH, sin_BTH)
            cache = cache.write(layer, positions_BT, k_BTGH, v_BTGH, valid_BT)
            a_BTNH = cache.attend(layer, q_BTNH, positions_BT,
                                  window=window,
                                  scale=cfg.attention_scale, softcap=cfg.attn_softcap)
            x_BTD, routing = attention_output_and_mlp(cfg, w, x_BTD, a_BTNH)
            return (x_BTD, cache), routing[0] if routes else None

        layers = jnp.arange(cfg.num_layers)
        (x_BTD, cache), experts_LBTK = jax.lax.scan(body, (x_BTD, cache),
                                                    (self.layers.stacked(), layers))
        if routes:
            return self.final_hidden(x_BTD), cache, jnp.moveaxis(experts_LBTK, 0, 2)
        return self.final_hidden(x_BTD), cache

    def head(self):
        """The output projection [D, V] in the compute dtype (the embedding's transpose when
        tied)."""
        head_DV = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head_DV.astype(self.cfg.compute_dtype)

    def logits(self, x_BTD):
        """float32 logits, soft-capped where the model says (Gemma 2)."""
        return ops.soft_cap(jnp.einsum("btd,dv->btv", x_BTD, self.head(),
                                       preferred_element_type=jnp.float32), self.cfg.final_softcap)

    def __call__(self, input_ids_BT, positions_BT=None, segment_ids_BT=None):
        return self.logits(self.hidden(input_ids_BT, positions_BT, segment_ids_BT))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStructs for values: shapes, dtypes and axes, no memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axis names of every parameter, as a pure dict shaped like the parameters."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    axes = jax.tree.map(lambda v: v.get_metadata()["axes"], state,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(axes)


def split_params(model: Transformer) -> tuple[nnx.GraphDef, dict]:
    """(graph definition, parameters as a pure nested dict of arrays)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge_params(graphdef: nnx.GraphDef, params: dict) -> Transformer:
    return nnx.merge(graphdef, params)
