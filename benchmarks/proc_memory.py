"""Peak memory measured in a fresh subprocess, for the benchmarks: `run_child` starts one,
`status_kib` reads /proc/self/status inside it (VmRSS now, VmHWM the high-water mark since the
process started)."""

import json
import os
import subprocess
import sys


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_child(script: str, flag: str, setting: str) -> dict:
    """Run `python script flag setting` and return the JSON object its last stdout line holds.
    glibc returns blocks above 64 KiB to the OS at once, so VmHWM sees tensors, not its caching."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, script, flag, setting], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
