import jax
import pytest
from jax.sharding import PartitionSpec as P

from sharding.mesh import MeshConfig, batch_sharding, logical_to_spec, make_mesh

pytestmark = pytest.mark.multi_device


def test_auto_axis_takes_the_remaining_devices():
    assert MeshConfig(data=2, tensor=2).resolve(8) == {"data": 2, "stage": 1, "fsdp": 2,
                                                        "expert": 1, "context": 1, "tensor": 2}
    mesh = make_mesh(MeshConfig(data=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1,
                                "tensor": 2}


def test_mesh_over_a_subset_of_devices():
    devices = jax.devices()[4:]
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), devices)
    assert set(mesh.devices.flat) == set(devices)


@pytest.mark.parametrize("cfg, n, message", [
    (MeshConfig(data=3, fsdp=1), 8, r"needs 3 devices, but 8 are given"),
    (MeshConfig(data=3), 8, r"the fixed axes use 3 devices, which does not divide the 8"),
])
def test_bad_mesh_names_the_numbers(cfg, n, message):
    with pytest.raises(ValueError, match=message):
        cfg.resolve(n)


def test_logical_rules():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("layers", "embed", "q_heads", "head_dim"), (4, 64, 8, 16),
                           mesh) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("vocab", "embed"), (100, 64), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("vocab", "embed"), (101, 64), mesh) == P(None, "fsdp")
    # a dimension the mesh axis does not divide stays replicated rather than failing
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (4, 64, 1, 16),
                           mesh) == P(None, "fsdp", None, None)
    assert batch_sharding(mesh, 3, leading=1).spec == P(None, ("data", "fsdp"), None)


def test_expert_axis_rules():
    """Experts split over `expert` then fsdp; the batch over every data-like axis, `expert`
    included (the dense layers treat it as data parallelism)."""
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    assert logical_to_spec(("layers", "experts", "embed", "mlp"), (2, 8, 64, 32), mesh) == P(
        None, ("expert", "fsdp"), None, "tensor")
    assert logical_to_spec(("layers", "experts", "embed", "mlp"), (2, 2, 64, 32), mesh) == P(
        None, "expert", "fsdp", "tensor")
    assert batch_sharding(mesh, 3, leading=1).spec == P(None, ("fsdp", "expert"), None)
