"""Launcher environments (deepspeed, torchrun, srun, none) -> one initialised process group."""
