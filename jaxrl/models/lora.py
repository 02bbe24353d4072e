"""LoRA (Hu et al. 2021) on a decoder layer's projections: W x + s * B(A x), with A [in, r] and
B [r, out] per targeted projection and layer, B zero at the start so the adapted model begins
as the base. s = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023), as PEFT
computes it.

Adapters are parameters of the layer stack named `<target>_lora_a` / `<target>_lora_b`
(PEFT's target names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), stacked
on the `layers` axis like their base matrices and sharded the same way on their input or
output axes (the rank axis is whole). They are float32 whatever the base's dtype. With LoRA on,
only the adapters train: the train step differentiates them alone and the optimizer's state
holds them alone (`trainable`, `with_trainable`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.grads import weight_grad

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = (*ATTENTION, *MLP)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: low-rank adapters on the layers' projections; off when rank is 0."""

    rank: int = 0                  # r; 0: no adapters, every weight trains
    alpha: float = 16.0            # PEFT's lora_alpha: the adapters' output scaled by alpha/r
    # PEFT's target_modules: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    # down_proj, or "all-linear" (all seven; a mixture-of-experts model's experts are not
    # targeted, its attention is).
    targets: tuple[str, ...] = ("all-linear",)
    use_rslora: bool = False       # scale by alpha / sqrt(r) (rank-stabilised LoRA)
    # PEFT's lora_dropout: in the train step each adapter's input drops this fraction of its
    # features (kept ones scaled by 1/(1-p)); the engine and evaluation run without it.
    dropout: float = 0.0
    # A PEFT LoRA folder to start the adapters from (trained elsewhere); its rank, alpha,
    # targets and rsLoRA setting become this config's (jaxrl/models/peft_io.py).
    init_from: str | None = None
    # Adapter sets held side by side (vLLM's multi-LoRA): an engine serving several clients
    # keeps N, each row choosing its own (`ROWS`); every adapter gains an axis of N after
    # `layers`. 1: one set, as a trainer holds.
    adapters: int = 1

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank} must be >= 0 (0: off)")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in
                                                      self.targets.split(",")))
        bad = [t for t in self.targets if t not in (*TARGETS, "all-linear")]
        if bad or not self.targets:
            raise ValueError(f"model.lora.targets={list(self.targets)}: {bad or 'empty'}; "
                             f"allowed: {', '.join(TARGETS)} or all-linear")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1)")
        if self.adapters < 1:
            raise ValueError(f"model.lora.adapters={self.adapters} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def modules(self, moe: bool = False) -> tuple[str, ...]:
        """The projections that carry adapters (a MoE model has no dense MLP to target)."""
        names = TARGETS if "all-linear" in self.targets else self.targets
        return tuple(t for t in TARGETS if t in names and not (moe and t in MLP))


def same_shape(a: LoraConfig, b: LoraConfig) -> bool:
    """Whether adapters made by `a` and `b` are interchangeable: same rank, scale and
    targets (each resolved: all-linear is all seven)."""
    return (a.rank, a.scale, a.modules(), a.modules(moe=True), a.adapters) == \
        (b.rank, b.scale, b.modules(), b.modules(moe=True), b.adapters)


def adapter_shapes(cfg) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """{parameter name: (shape, logical axes)} of every adapter of model config `cfg`, with the
    leading `layers` axis; none when LoRA is off."""
    if not cfg.lora.enabled:
        return {}
    L, D, N, G, H, F, r = (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.mlp_dim, cfg.lora.rank)
    ins = {"q_proj": ((D,), ("embed",)), "k_proj": ((D,), ("embed",)),
           "v_proj": ((D,), ("embed",)), "o_proj": ((N, H), ("q_heads", "head_dim")),
           "gate_proj": ((D,), ("embed",)), "up_proj": ((D,), ("embed",)),
           "down_proj": ((F,), ("mlp",))}
    kv = ((G, H), ("kv_heads", "head_dim"))
    outs = {"q_proj": ((N, H), ("q_heads", "head_dim")), "k_proj": kv, "v_proj": kv,
            "o_proj": ((D,), ("embed",)),
            "gate_proj": ((F,), ("mlp",)), "up_proj": ((F,), ("mlp",)),
            "down_proj": ((D,), ("embed",))}
    n = cfg.lora.adapters
    side = ((L, n), ("layers", "lora_adapters")) if n > 1 else ((L,), ("layers",))
    shapes = {}
    for t in cfg.lora.modules(moe=bool(cfg.num_experts)):
        (i_shape, i_axes), (o_shape, o_axes) = ins[t], outs[t]
        shapes[f"{t}_lora_a"] = ((*side[0], *i_shape, r), (*side[1], *i_axes, "lora_rank"))
        shapes[f"{t}_lora_b"] = ((*side[0], r, *o_shape), (*side[1], "lora_rank", *o_axes))
    return shapes


def init_adapter(key, name: str, shape: tuple[int, ...]) -> jax.Array:
    """PEFT's initialisation: A uniform in +-1/sqrt(fan_in) (Kaiming-uniform with a=sqrt(5)),
    B zero."""
    if name.endswith("_lora_b"):
        return jnp.zeros(shape, jnp.float32)
    fan_in = int(np.prod(shape[1:-1]))
    bound = 1 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


# A layer's dropout key (raw key data) among its parameters, put there by the train step
# (`dropout_stack`) when model.lora.dropout is set; no model or checkpoint holds one.
DROPOUT_KEY = "lora_dropout_key"
# Under LoraConfig.adapters > 1, each row's adapter [B] among a layer's parameters, put there
# by the caller (Transformer.extend's `adapters_B`, `rows_stack`); absent: adapter 0.
ROWS = "lora_rows"


def project(w: dict, name: str, x, equation: str, lo: LoraConfig):
    """x through projection `name` of one layer's weights `w` by `equation` (e.g.
    "btd,dnh->btnh"), plus its adapter's s * B(A x) when `w` has one (`lo`: the model's
    LoRA settings), A's input dropped out when `w` carries a dropout key."""
    y = jnp.einsum(equation, x, w[name])
    a = w.get(f"{name}_lora_a")
    if a is None:
        return y
    x_sub, w_sub = equation.split("->")[0].split(",")
    n_in = sum(c in x_sub for c in w_sub)             # the axes contracted: x's last n_in
    if lo.adapters > 1:
        rows_B = w.get(ROWS)
        if rows_B is None:
            rows_B = jnp.zeros(x.shape[0], jnp.int32)
        delta = _per_row(x, a, w[f"{name}_lora_b"], n_in, rows_B)
        return y + lo.scale * delta.reshape(y.shape)
    x_flat = x.reshape(-1, int(np.prod(x.shape[-n_in:])))
    if DROPOUT_KEY in w and lo.dropout:
        key = jax.random.fold_in(jax.random.wrap_key_data(w[DROPOUT_KEY]), TARGETS.index(name))
        keep = jax.random.bernoulli(key, 1.0 - lo.dropout, x_flat.shape)
        x_flat = jnp.where(keep, x_flat / (1.0 - lo.dropout), 0).astype(x_flat.dtype)
    a_flat = a.astype(x.dtype).reshape(x_flat.shape[1], -1)
    b = w[f"{name}_lora_b"].astype(x.dtype)
    b_flat = b.reshape(b.shape[0], -1)
    delta = low_rank(x_flat, a_flat, b_flat)
    return y + lo.scale * delta.reshape(y.shape)


def _per_row(x, a_N, b_N, n_in: int, rows_B):
    """Each row b of x [B, ..., in] through its own adapter rows_B[b] of the N held: A [N, in,
    r] and B [N, r, out] gathered per row (vLLM's punica, as two batched matmuls)."""
    b = x.shape[0]
    x_BTI = x.reshape(b, -1, int(np.prod(x.shape[-n_in:])))
    a_BIR = a_N[rows_B].astype(x.dtype).reshape(b, x_BTI.shape[-1], -1)
    b_BRO = b_N[rows_B].astype(x.dtype)
    b_BRO = b_BRO.reshape(b, b_BRO.shape[1], -1)
    return jnp.einsum("btr,bro->bto", jnp.einsum("bti,bir->btr", x_BTI, a_BIR), b_BRO)


def rows_stack(stack, rows_B):
    """Layer-stack function `stack` (`run_layers`'s signature) with each row's adapter
    `rows_B` beside every layer's weights (`ROWS`): a model holding several adapter sets run
    whole (the engine's `score`)."""
    def run(cfg, stacked, *args, **kwargs):
        layers = jax.tree.leaves(stacked)[0].shape[0]
        return stack(cfg, {**stacked, ROWS: jnp.broadcast_to(rows_B, (layers, *rows_B.shape))},
                     *args, **kwargs)
    return run


def dropout_stack(stack, key):
    """Layer-stack function `stack` (`run_layers`'s signature) with a dropout key of its own
    for each layer beside its weights (`DROPOUT_KEY`), drawn from `key`: what the train step
    runs when model.lora.dropout is set."""
    def run(cfg, stacked, *args, **kwargs):
        layers = jax.tree.leaves(stacked)[0].shape[0]
        keys = jax.random.key_data(jax.random.split(key, layers))
        return stack(cfg, {**stacked, DROPOUT_KEY: keys}, *args, **kwargs)
    return run


@jax.custom_vjp
def low_rank(x_TI, a_IR, b_RO):
    """(x @ A) @ B for [tokens, in] x: its backward contracts each adapter gradient over the
    tokens with the wider operand first (layers.weight_grad), sparing XLA:CPU a transposed
    copy of every [tokens, wide] operand (a 30M-parameter step: see `jaxrl bench
    lora_step`)."""
    return (x_TI @ a_IR) @ b_RO


def _low_rank_fwd(x_TI, a_IR, b_RO):
    low_TR = x_TI @ a_IR
    return low_TR @ b_RO, (x_TI, a_IR, b_RO, low_TR)


def _low_rank_bwd(res, dy_TO):
    x_TI, a_IR, b_RO, low_TR = res
    dlow_TR = dy_TO @ b_RO.T
    return (dlow_TR @ a_IR.T, weight_grad(x_TI, dlow_TR), weight_grad(low_TR, dy_TO))


low_rank.defvjp(_low_rank_fwd, _low_rank_bwd)


def is_adapter(name: str) -> bool:
    return "_lora_" in name


def trainable(params: dict) -> dict:
    """The adapters of a parameter tree (`{"layers": {...}}`), what trains under LoRA."""
    return {"layers": {k: v for k, v in params["layers"].items() if is_adapter(k)}}


def with_trainable(params: dict, adapters: dict) -> dict:
    """`params` with its adapters replaced by `adapters` (from `trainable`)."""
    return {**params, "layers": {**params["layers"], **adapters["layers"]}}


def frozen(params: dict) -> dict:
    """Everything but the adapters."""
    return {**params, "layers": {k: v for k, v in params["layers"].items()
                                 if not is_adapter(k)}}
