"""Model files on disk, jax-free: the cache folder (cache.py), the embedded default model
(default_model.py: SmolLM2-135M-Instruct's GGUF, converted once) and the GGUF -> HF folder
conversion (gguf_convert.py). Ground floor: config/ resolves model folders through it."""
