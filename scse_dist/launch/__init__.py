"""Jobs on a batch system: scse-launch, what every job runs (run_job), crash retries, child
processes, and the backends behind one protocol (the process group: scse_dist.distributed)."""
