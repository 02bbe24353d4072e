"""The train step's XLA options on CPU: a wide model's step is compiled outside XLA's YNNPACK
fusions (faster float32 matmuls, docs/benchmarks.md), with the numbers of the step XLA compiles
by default; a narrow model's keeps them."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import ModelConfig, abstract_model, split_params
from jaxrl.optim_config import OptimConfig
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import (PLAIN_DOT_WIDTH, Layout, compiler_options, jit_train_step,
                              split_microbatches)
from sharding.mesh import MeshConfig, batch_sharding, make_mesh

CFG = ModelConfig(vocab_size=64, embed_dim=PLAIN_DOT_WIDTH, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, mlp_dim=128)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)


def test_cpu_step_leaves_out_ynn_fusions_with_the_default_steps_numbers():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert compiler_options(mesh, PLAIN_DOT_WIDTH) == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert compiler_options(mesh, PLAIN_DOT_WIDTH // 2) is None
    tx = make_optimizer(OPTIM, total_steps=4)
    shardings = state_shardings(CFG, tx, mesh)
    graphdef, _ = split_params(abstract_model(CFG))
    tuned = jit_train_step(graphdef, tx, shardings, Layout(mesh), lr_schedule(OPTIM, 4),
                           width=CFG.embed_dim)
    default = jax.jit(tuned.__wrapped__, donate_argnums=0)   # XLA's own options
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, size=(16, 33)).astype(np.int32)
    batch = jax.device_put(split_microbatches(
        {"input_ids": ids[:, :-1], "targets": ids[:, 1:],
         "loss_mask": np.ones((16, 32), np.float32)}, 2), batch_sharding(mesh, 3, leading=1))
    state = init_state(CFG, tx, shardings, seed=0)
    assert "__ynn_fusion" in default.lower(state, batch).compile().as_text()
    assert "__ynn_fusion" not in tuned.lower(state, batch).compile().as_text()

    results = []
    for step in (tuned, default):
        s, losses = jax.tree.map(jnp.copy, state), []
        for _ in range(3):
            s, metrics = step(s, batch)
            losses.append(float(metrics["loss"]))
        results.append((losses, jax.device_get(s["params"])))
    (tuned_losses, tuned_params), (losses, params) = results
    assert tuned_losses[2] < tuned_losses[0]
    np.testing.assert_allclose(tuned_losses, losses, rtol=1e-5)
    # Adam divides by sqrt(v): where a gradient is near zero, a last-bit difference can move
    # a weight by up to lr (1e-2) a step. So: almost every weight within 1e-4, none beyond
    # what three such steps allow.
    diff = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel() for a, b in
                           zip(jax.tree.leaves(tuned_params), jax.tree.leaves(params))])
    assert np.mean(diff > 1e-4) < 1e-3 and diff.max() <= 3 * 2 * OPTIM.lr
