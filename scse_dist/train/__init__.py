"""Training on DeepSpeed. Submodules import torch/deepspeed lazily where they can, so
`scse_dist.train.cli` parses a config (and fails on a bad one) without starting anything."""
