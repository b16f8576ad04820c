"""Checkpoints and exports: DeepSpeed tags (atomic save, verified resume, resharding), remote run
dirs, fp32 weights from any ZeRO stage, the export and `load_model` for either. Nothing is
imported here, so `scse-ckpt --help` starts without torch."""
