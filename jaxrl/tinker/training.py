"""LoRA training clients on one copy of a base model: their adapters, Adam states and
accumulated gradients, and the compiled programs that run them.

Clients whose adapters have the same shape (rank and targets) run together: a forward_backward
of K clients is one program vmapped over the client axis, the base weights shared (not
stacked), each client with its own adapters, data and loss settings. Rows and tokens are padded
to powers of two (padding is masked out of every loss; attention is causal, so a datum's tokens
never see the padding after them), clients to a power of two with a masked copy of the first.
Gradients are summed into the client's accumulator until its optim_step, which runs Adam with
decoupled weight decay and the step's AdamParams (traced values: a new learning rate is not a
new program).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import abstract_model, lora, merge_params, split_params
from jaxrl.models.lora import LoraConfig
from jaxrl.tinker import losses
from jaxrl.tinker.wire import Datum
from jaxrl.train.objectives import token_logp

ALPHA = 32.0          # LoRA's alpha for every rank (scale alpha / rank), as SkyRL tx and PEFT's
MIN_TOKENS = 16       # the shortest padded length


def lora_config(rank: int, train_attn: bool, train_mlp: bool) -> LoraConfig:
    """jaxrl's LoRA settings for the SDK's choices; rank 0 (or no target): no adapters."""
    targets = (lora.ATTENTION if train_attn else ()) + (lora.MLP if train_mlp else ())
    if rank <= 0 or not targets:
        return LoraConfig()
    return LoraConfig(rank=rank, alpha=ALPHA, targets=targets)


@dataclasses.dataclass
class Client:
    """One training client: what a model_id names."""

    model_id: str
    base_model: str
    lora: LoraConfig
    adapters: dict                      # {"layers": {name: f32 array}}
    m: dict                             # Adam's moments, like `adapters`
    v: dict
    step: int = 0                       # optim_steps taken
    grads: dict | None = None           # summed since the last optim_step; None: none yet


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


class Trainer:
    """The base weights (float32, adapters apart) and a program cache per adapter shape."""

    def __init__(self, model, max_len: int):
        self.cfg = dataclasses.replace(model.cfg, lora=LoraConfig())
        self.frozen = lora.frozen(split_params(model)[1])
        self.max_len = max_len
        self._graphdefs: dict[tuple, object] = {}

    # -- clients -----------------------------------------------------------------------------
    def new_client(self, model_id: str, base_model: str, lo: LoraConfig, seed: int) -> Client:
        cfg = dataclasses.replace(self.cfg, lora=lo)
        key = jax.random.PRNGKey(seed)
        adapters = {"layers": {
            name: lora.init_adapter(jax.random.fold_in(key, i), name, shape)
            for i, (name, (shape, _)) in enumerate(sorted(lora.adapter_shapes(cfg).items()))}}
        zeros = jax.tree.map(jnp.zeros_like, adapters)
        return Client(model_id, base_model, lo, adapters, zeros, zeros)

    def _graphdef(self, lo: LoraConfig):
        key = _shape_key(lo)
        if key not in self._graphdefs:
            cfg = dataclasses.replace(self.cfg, lora=lo)
            self._graphdefs[key] = split_params(abstract_model(cfg))[0]
        return self._graphdefs[key]

    # -- forward, forward_backward -----------------------------------------------------------
    def forward_backward(self, clients: list[Client], loss_fn: str,
                         configs: list[dict[str, float]], data: list[list[Datum]],
                         backward: bool) -> list[tuple[list[dict], dict]]:
        """Runs each client's datums (already checked: losses.check) in one program; with
        `backward`, adds each one's gradient to its accumulator. Returns, per client, each
        datum's outputs (`logprobs`, `elementwise_loss`) and the metrics (`loss:sum`)."""
        lo = clients[0].lora
        assert all(_shape_key(c.lora) == _shape_key(lo) for c in clients)
        longest = max(len(d.tokens) for ds in data for d in ds)
        if longest > self.max_len:
            raise ValueError(f"a datum of {longest} tokens; this service's context is "
                             f"{self.max_len}")
        k, b = _pow2(len(clients)), _pow2(max(len(ds) for ds in data))
        t = min(_pow2(longest, MIN_TOKENS), self.max_len)
        batch = _pad_batch(loss_fn, data, k, b, t)
        clip = np.zeros((k, 2), np.float32)
        for i, c in enumerate(configs):
            clip[i] = losses.thresholds(losses.LOSSES[loss_fn], c)
        adapters = [c.adapters for c in clients]
        adapters += [adapters[0]] * (k - len(clients))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *adapters)
        program = _program(self._graphdef(lo), loss_fn, backward)
        logp_KBT, loss_KBT, grads_K = program(self.frozen, stacked, batch, clip)
        logp_KBT, loss_KBT = np.asarray(logp_KBT), np.asarray(loss_KBT)
        results = []
        for i, (client, ds) in enumerate(zip(clients, data)):
            if backward:
                g = jax.tree.map(lambda a: a[i], grads_K)
                client.grads = g if client.grads is None else _add(client.grads, g)
            outputs = [{"logprobs": logp_KBT[i, j, :len(d.tokens)],
                        "elementwise_loss": loss_KBT[i, j, :len(d.tokens)]}
                       for j, d in enumerate(ds)]
            total = float(sum(o["elementwise_loss"].sum(dtype=np.float64) for o in outputs))
            results.append((outputs, {"loss:sum": total}))
        return results

    # -- optim_step ----------------------------------------------------------------------------
    def optim_step(self, client: Client, adam: dict) -> dict:
        """Adam on the client's accumulated gradient (none: a zero one), which it clears."""
        grads = client.grads if client.grads is not None else jax.tree.map(
            jnp.zeros_like, client.adapters)
        hp = {k: jnp.float32(adam[k]) for k in ADAM_KEYS}
        client.adapters, client.m, client.v, norm = _adam(
            client.adapters, grads, client.m, client.v, jnp.float32(client.step + 1), hp)
        client.step += 1
        client.grads = None
        return {"grad_norm:mean": float(norm)}


ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def check_adam(adam: dict) -> dict:
    """AdamParams with the SDK's defaults filled in; ValueError naming a bad one."""
    full = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
            "weight_decay": 0.0, "grad_clip_norm": 0.0, **adam}
    extra = set(full) - set(ADAM_KEYS) - {"type"}
    if extra:
        raise ValueError(f"adam_params {sorted(extra)}: it takes {list(ADAM_KEYS)}")
    for k in ADAM_KEYS:
        v = full[k]
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"adam_params.{k} = {v!r} must be a finite number")
    if full["learning_rate"] < 0 or full["eps"] < 0 or full["weight_decay"] < 0:
        raise ValueError("adam_params: learning_rate, eps and weight_decay must be >= 0")
    for k in ("beta1", "beta2"):
        if not 0 <= full[k] < 1:
            raise ValueError(f"adam_params.{k} = {full[k]} must be in [0, 1)")
    return full


def _shape_key(lo: LoraConfig) -> tuple:
    return (lo.rank, lo.scale, lo.modules()) if lo.enabled else ()


def _pad_batch(loss_fn: str, data: list[list[Datum]], k: int, b: int, t: int) -> dict:
    names = ("weights",) if loss_fn == "cross_entropy" else ("logprobs", "advantages")
    batch = {"input_ids": np.zeros((k, b, t), np.int32), "targets": np.zeros((k, b, t), np.int32),
             "mask": np.zeros((k, b, t), np.float32),
             **{n: np.zeros((k, b, t), np.float32) for n in names}}
    for i, ds in enumerate(data):
        for j, d in enumerate(ds):
            n = len(d.tokens)
            batch["input_ids"][i, j, :n] = d.tokens
            batch["targets"][i, j, :n] = d.inputs["target_tokens"]
            batch["mask"][i, j, :n] = 1.0
            for name in names:
                batch[name][i, j, :n] = d.inputs.get(name, 1.0)
    return batch


@functools.lru_cache(maxsize=None)
def _program(graphdef, loss_fn: str, backward: bool):
    """(frozen base, adapters [K, ...], batch [K, B, T], clip [K, 2]) -> (logp, token losses
    [K, B, T], gradients [K, ...] or None)."""

    def one(frozen, adapters, batch, clip):
        def total(adapters):
            model = merge_params(graphdef, lora.with_trainable(frozen, adapters))
            logp_BT, _, _ = token_logp(model, batch)
            loss_BT = losses.token_losses(loss_fn, logp_BT, batch, clip[0], clip[1])
            return loss_BT.sum(), (logp_BT, loss_BT)

        if not backward:
            return *total(adapters)[1], None
        (_, (logp_BT, loss_BT)), grads = jax.value_and_grad(total, has_aux=True)(adapters)
        return logp_BT, loss_BT, grads

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 0, 0)))


@jax.jit
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def _adam(params, grads, m, v, count, hp):
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    clip = hp["grad_clip_norm"]
    scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    b1, b2 = hp["beta1"], hp["beta2"]
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g * scale, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * (g * scale) ** 2, v, grads)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** count
    lr, eps, wd = hp["learning_rate"], hp["eps"], hp["weight_decay"]
    params = jax.tree.map(
        lambda p, m, v: p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + wd * p), params, m, v)
    return params, m, v, norm
