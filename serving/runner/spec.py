"""What fixes every program of an engine (`Spec`: model config, engine config, mesh, pool size;
equal specs share their executables) and the state its decode programs carry (`DecodeState`:
the page pool and each slot's sampling state), with the empty state the `init` program makes."""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, abstract_model, param_axes, split_params
from serving.runner.paged_kv import KERNEL_PLATFORMS, PagedKV
from serving.runner.sampling import MAX_LOGIT_BIAS
from sharding import mesh as shd

POOL_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The page pool and everything `generate` needs about every slot."""

    kv: jax.Array             # [L, P, K, 2G, H]: the pool (serving/runner/paged_kv.py)
    lengths: jax.Array        # int32 [S]: tokens of each slot's sequence in the pool
    tokens: jax.Array         # int32 [S]: the token each slot feeds next
    counts: jax.Array         # int32 [S]: tokens sampled so far (drives the RNG)
    temperature: jax.Array    # float32 [S]
    top_k: jax.Array          # int32 [S]
    top_p: jax.Array          # float32 [S]
    seeds: jax.Array          # uint32 [S]
    banned: jax.Array         # int32 [S]: the token (EOS) a slot may not draw before ...
    min_tokens: jax.Array     # int32 [S]: ... it has sampled this many (-1: no ban)
    sample_index: jax.Array   # int32 [S]: which of the request's n samples
    bias_ids: jax.Array       # int32 [S, MAX_LOGIT_BIAS]: logit_bias's tokens (-1: none) ...
    bias_values: jax.Array    # float32 [S, MAX_LOGIT_BIAS]: ... and their biases
    presence: jax.Array       # float32 [S]: presence_penalty ...
    frequency: jax.Array      # float32 [S]: ... and frequency_penalty, applied from ...
    seen: jax.Array           # int32 [S, V]: ... how often each slot has drawn each token


# What a decode batch gathers for its rows (`seen` is gathered only when a row is penalized).
PER_SLOT = tuple(f.name for f in dataclasses.fields(DecodeState) if f.name not in ("kv", "seen"))
# The per-slot fields a request's sampling parameters fill (serving.runner.engine's
# _sampling_arrays); the first token is drawn with them alone.
SAMPLING = ("temperature", "top_k", "top_p", "seeds", "banned", "min_tokens", "bias_ids",
            "bias_values")
# Each per-slot field's (dtype, shape after the slot axis): an insert's and a first draw's rows
# are dicts of arrays [K, ...] keyed by these names.
ROW_TYPES = {n: (jnp.int32, ()) for n in PER_SLOT} | {
    "temperature": (jnp.float32, ()), "top_p": (jnp.float32, ()), "seeds": (jnp.uint32, ()),
    "bias_ids": (jnp.int32, (MAX_LOGIT_BIAS,)), "bias_values": (jnp.float32, (MAX_LOGIT_BIAS,)),
    "presence": (jnp.float32, ()), "frequency": (jnp.float32, ())}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What fixes every program of an engine: equal specs share their executables."""

    model_cfg: ModelConfig
    cfg: "EngineConfig"  # noqa: F821 (serving/runner/engine_config.py)
    mesh: Mesh
    num_pages: int

    @functools.cached_property
    def graphdef(self):
        return split_params(abstract_model(self.model_cfg))[0]

    @functools.cached_property
    def param_target(self):
        """ShapeDtypeStructs (with shardings) of the weights in the serving dtype and layout."""
        _, abstract = split_params(abstract_model(self.model_cfg))
        shardings = shd.tree_shardings(param_axes(self.model_cfg), abstract, self.mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        c = self.model_cfg
        return (c.num_layers, self.num_pages, self.cfg.page_size, 2 * c.num_kv_heads,
                c.head_dim)

    def pool_sharding(self, pages: int | None = None):
        """The pool's sharding: over kv heads where the tensor axis divides them. Decided on
        the G kv heads, not the 2G interleaved ones, so a head's keys and values stay on one
        device."""
        c = self.model_cfg
        per_head = (c.num_layers, pages or self.num_pages, self.cfg.page_size, c.num_kv_heads,
                    c.head_dim)
        return shd.logical_to_sharding(POOL_AXES, per_head, self.mesh)

    def state_shardings(self) -> DecodeState:
        rep = shd.replicated(self.mesh)
        return DecodeState(kv=self.pool_sharding(), seen=rep, **{n: rep for n in PER_SLOT})

    def abstract_state(self) -> DecodeState:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(partial(empty_state, self)), self.state_shardings())

    def cache(self, kv, table) -> PagedKV:
        head_axis = (tuple(self.pool_sharding().spec) + (None,) * 5)[3]
        home = KERNEL_PLATFORMS.get(self.cfg.attention)
        return PagedKV(kv, table, self.cfg.attention, self.mesh, head_axis,
                       interpret=self.mesh.devices.flat[0].platform != home)


def empty_state(spec: Spec) -> DecodeState:
    s = spec.cfg.max_concurrent_decodes
    zeros = lambda d: jnp.zeros((s,), d)  # noqa: E731
    return pinned(spec, DecodeState(kv=jnp.zeros(spec.pool_shape, spec.cfg.pool_dtype),
                       lengths=zeros(jnp.int32), tokens=zeros(jnp.int32),
                       counts=zeros(jnp.int32), temperature=zeros(jnp.float32),
                       top_k=zeros(jnp.int32), top_p=zeros(jnp.float32),
                       seeds=zeros(jnp.uint32), banned=zeros(jnp.int32) - 1,
                       min_tokens=zeros(jnp.int32), sample_index=zeros(jnp.int32),
                       bias_ids=jnp.full((s, MAX_LOGIT_BIAS), -1, jnp.int32),
                       bias_values=jnp.zeros((s, MAX_LOGIT_BIAS), jnp.float32),
                       presence=zeros(jnp.float32), frequency=zeros(jnp.float32),
                       seen=jnp.zeros((s, spec.model_cfg.vocab_size), jnp.int32)))[0]


# Every output is pinned to one layout (the pool over kv heads, everything else replicated):
# each program is compiled for the layouts the others produce, ahead of time.
def pinned(spec: Spec, state: DecodeState, *arrays):
    rep = shd.replicated(spec.mesh)
    state = jax.lax.with_sharding_constraint(state, spec.state_shardings())
    return (state, *(jax.lax.with_sharding_constraint(a, rep) for a in arrays))
