"""GGUF models (Ollama's library and stores, llama.cpp's format) converted to MLX model
directories that mlx_lm loads, and MLX directories written as GGUF (for tests and benchmarks).

Modules, each small and numpy-first (mlx only where noted):
- quants.py     one GGUF tensor (any ggml type) -> MLX weights: float arrays, or MLX affine
                quantized (packed uint32 weight, scales, biases) with bits/group size; exact
                for the types whose blocks map onto MLX groups of 32; K-quant and Q4_K/Q6_K
                writers for test data.
- tokenizer.py  `tokenizer.ggml.*` metadata <-> a Hugging Face tokenizer.json and
                tokenizer_config.json (the BPE "gpt2" kind and the SentencePiece "llama" kind).
- arch.py       per architecture: GGUF tensor names and metadata <-> Hugging Face names and
                config.json (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, granite,
                qwen3moe),
                with the tensor transforms llama.cpp's converter applies (q/k permutation,
                Gemma's norm + 1) undone or redone.
- convert.py    a GGUF file -> an MLX model directory (run as a child process).
- write.py      an MLX/Hugging Face model directory -> a GGUF file of a given type.
"""
