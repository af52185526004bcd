"""Device meshes and sharding rules; several processes through jax.distributed."""
