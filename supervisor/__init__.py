"""The mlxr supervisor: the public HTTP API, the model store, and the runners' lifecycle."""
