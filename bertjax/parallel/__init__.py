"""Parallelism: device meshes, sharding rules, multi-host setup."""
