"""The model store: Ollama's layout of manifests and content-addressed blobs."""
