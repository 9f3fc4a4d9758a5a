"""Device meshes: `--mesh`, logical axes and shardings (device_mesh.py), and host data to arrays
on the mesh and back (arrays.py)."""
