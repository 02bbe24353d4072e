"""Expert parallelism: a mixture-of-experts layer whose experts are split over the mesh's
`expert` axis, each device running its own experts on the tokens every device sends it.

Under a mesh with `expert` > 1 (the train step sets it as the abstract mesh), `moe.moe_mlp`
runs this in a `shard_map` over that axis alone (data, fsdp and tensor stay automatic). Each
device routes its own tokens, sorts their (token, choice) pairs by the device that holds the
chosen expert, and exchanges them with one `all_to_all`; each device then runs its experts as
grouped matmuls over what it received (`ragged_dot`), and a second `all_to_all` brings the
outputs back, to be weighted and summed per token as on one device.

The exchange is dense: each device reserves room for all of its pairs going to any one device
(tokens x K rows per peer), so no token is ever dropped and the result equals the unsharded
layer, at the cost of buffers `expert` times the pairs. (A ragged all-to-all, which sends only
what each peer gets, exists on TPU and GPU; XLA:CPU does not implement it.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "expert"


def expert_mesh():
    """The abstract mesh in context when it has an `expert` axis of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return None
    return mesh


def parallel_experts(route, w: dict, x_SD, replay_SK, mesh):
    """`route(router, x_SD, replay_SK) -> (experts [S, K], weights [S, K], own [S, K], probs
    [S, E])` and the experts of `w` run with the experts split over `mesh`'s expert axis:
    (output [S, D], own [S, K], probs [S, E]), as moe.moe_mlp_routed computes them."""
    e = w["experts_gate"].shape[0]
    n = mesh.shape[AXIS]
    if e % n:
        raise ValueError(f"model.num_experts={e} is not divisible by mesh.expert={n}")
    if x_SD.shape[0] % n:
        raise ValueError(f"{x_SD.shape[0]} tokens cannot be split over mesh.expert={n}")
    rows = P(AXIS)
    experts = P(AXIS)

    def local(x_SD, router_DE, gate_EDF, up_EDF, down_EFD, *replay):
        experts_SK, weights_SK, own_SK, probs_SE = route(router_DE, x_SD,
                                                         replay[0] if replay else None)
        out_SD = _exchange(x_SD, experts_SK, weights_SK, gate_EDF, up_EDF, down_EFD, n)
        return out_SD, own_SK, probs_SE

    args = [x_SD, w["router"], w["experts_gate"], w["experts_up"], w["experts_down"]]
    specs = [rows, P(), experts, experts, experts]
    if replay_SK is not None:
        args.append(replay_SK)
        specs.append(rows)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=(rows, rows, rows),
                         axis_names={AXIS}, check_vma=False)(*args)


def _exchange(x_SD, experts_SK, weights_SK, gate_EDF, up_EDF, down_EFD, n: int):
    """One device's part: its tokens' pairs to the devices of their experts and back."""
    s, k = experts_SK.shape
    d = x_SD.shape[-1]
    local_e = gate_EDF.shape[0]                     # experts on this device
    pairs = s * k
    expert_R = experts_SK.reshape(-1)
    dest_R = expert_R // local_e
    order_R = jnp.argsort(dest_R, stable=True)      # pairs grouped by destination device
    dest_sorted = dest_R[order_R]
    counts_N = jnp.bincount(dest_R, length=n)
    slot_R = jnp.arange(pairs) - (jnp.cumsum(counts_N) - counts_N)[dest_sorted]
    # Room for every pair at every peer: slot < pairs always, nothing is dropped.
    send_NCD = jnp.zeros((n, pairs, d), x_SD.dtype).at[dest_sorted, slot_R].set(
        x_SD[order_R // k])
    send_NC = jnp.full((n, pairs), local_e, jnp.int32).at[dest_sorted, slot_R].set(
        expert_R[order_R] % local_e)                # local_e: an empty slot
    recv_NCD = jax.lax.all_to_all(send_NCD, AXIS, 0, 0)
    recv_NC = jax.lax.all_to_all(send_NC, AXIS, 0, 0)
    # This device's experts on what it received: rows sorted by expert, empty slots last
    # (outside every group: ragged_dot leaves them zero).
    which_M = recv_NC.reshape(-1)
    by_expert = jnp.argsort(which_M, stable=True)
    sizes_E = jnp.bincount(which_M, length=local_e + 1)[:local_e].astype(jnp.int32)
    x_MD = recv_NCD.reshape(-1, d)[by_expert]
    gate = jax.lax.ragged_dot(x_MD, gate_EDF, sizes_E)
    up = jax.lax.ragged_dot(x_MD, up_EDF, sizes_E)
    y_MD = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_EFD, sizes_E)
    y_NCD = jnp.zeros_like(y_MD).at[by_expert].set(y_MD).reshape(n, pairs, d)
    back_NCD = jax.lax.all_to_all(y_NCD, AXIS, 0, 0)
    out_RD = back_NCD[dest_sorted, slot_R]           # in `order_R`'s order
    out_RD = out_RD * weights_SK.reshape(-1)[order_R][:, None].astype(out_RD.dtype)
    return jnp.zeros_like(x_SD).at[order_R // k].add(out_RD)
