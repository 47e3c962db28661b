"""Device infrastructure: meshes and sharding rules, multi-process start-up, host memory."""
