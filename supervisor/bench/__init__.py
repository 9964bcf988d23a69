"""`mlxr bench`: streaming load against our runner, our server and mlx_lm.server, side by side."""
