import jax
import pytest
from jax.sharding import PartitionSpec as P

from ctopd_jax.mesh.device_mesh import MeshError, logical_spec, make_mesh, parse_mesh, resolve_mesh_shape


def test_parse_and_resolve():
    assert parse_mesh("data=2,fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
    assert resolve_mesh_shape({"tensor": 2, "data": -1}, 8) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert resolve_mesh_shape(None, 8) == {"data": 8, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("text, field", [
    ("data=3,tensor=2", "product"),
    ("pipe=2", "data"),
    ("data=x", "mesh.data"),
    ("data=-1,fsdp=-1", "-1"),
    ("data=0", "mesh.data"),
])
def test_bad_mesh_names_the_problem(text, field):
    with pytest.raises(MeshError, match=field.replace("*", r"\*")):
        resolve_mesh_shape(parse_mesh(text), 8)


def test_mesh_over_eight_host_devices():
    assert jax.device_count() == 8
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # Divisible dims shard; indivisible ones fall back to replication along that axis.
    assert logical_spec(mesh, ("embed", "mlp"), (64, 128)) == P("fsdp", "tensor")
    # spelled as jit spells its outputs: no trailing unsharded axes
    assert tuple(logical_spec(mesh, ("embed", "kv_heads", None), (64, 1, 32))) == ("fsdp",)
    assert tuple(logical_spec(mesh, ("batch", "length"), (8, 5))) == (("data", "fsdp"),)
    assert tuple(logical_spec(mesh, ("batch", "length"), (2, 5))) == ("data",)
    assert tuple(logical_spec(mesh, ("length", "embed"), (5, 64))) == (None, "fsdp")
