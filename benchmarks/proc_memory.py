"""Process memory from /proc/self/status, for the benchmarks' fresh-subprocess peak measurements
(VmRSS now, VmHWM the high-water mark since the process started)."""


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
