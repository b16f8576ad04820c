"""Jobs on a batch system: scse-launch (train, then the evaluations and the report), what every
job runs (run_job), crash retries, child processes, and the backends (Slurm, this machine) behind
one protocol. The process group inside a job is scse_dist.distributed's."""
