"""Checkpoints and exports: DeepSpeed tags (atomic save, resume with verification and fallback,
resharding to another world size), remote run dirs, fp32 weights from any ZeRO stage, the export
(safetensors + config + tokenizer) and `load_model` for either. Below train/ and eval/, above
model/ and data/ (tests/test_imports.py holds the layers).

Nothing is imported here, so `scse-ckpt --help` starts without torch."""
