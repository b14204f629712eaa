"""Many devices and processes as one (jax): the mesh and its logical-axis rules, joining the jax.distributed
group, and how the group's processes agree on the loop's flags."""
