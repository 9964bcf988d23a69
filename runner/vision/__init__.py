"""Vision models: an image tower (mlx-vlm) beside the batched mlx-lm text model."""
