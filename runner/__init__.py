"""The mlxr runner: one MLX model per process, many requests batched on one engine thread."""
