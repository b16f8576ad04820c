"""Metrics: peak FLOP/s sources, the JSONL file (appending across resumes), wandb offline on rank
0."""

import json
import time

import pytest
import torch

from scse_dist.train.metrics import MetricsLogger, format_line, peak_flops, peak_memory
from scse_dist.train.metrics_config import WandbConfig


def row(step, loss, mfu=0.25):
    return {"step": step, "loss": loss, "lr": 1e-3, "depth": 3, "tokens_per_s": 1234.5, "mfu": mfu,
            "step_time_s": 0.05, "tokens": step * 100}


def test_cpu_has_no_peak_unless_the_env_sets_one(monkeypatch):
    """A matmul timed on a shared CPU is not a peak (it read MFU above 100%): none on CPU."""
    monkeypatch.delenv("SCSE_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setenv("SCSE_PEAK_FLOPS", "3.5e12")
    assert peak_flops(torch.device("cpu")) == 3.5e12


def test_cuda_peak_is_the_bf16_table_entry(monkeypatch):
    monkeypatch.delenv("SCSE_PEAK_FLOPS", raising=False)
    for name, peak in [("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 3090", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda")) == peak, name


def test_format_line_shows_every_field():
    line = format_line(row(40, 3.14159))
    assert line == "step     40 | loss 3.1416 | lr 1.000e-03 | T  3 | tok/s 1,234 | step 50 ms " \
                   "| mfu 25.00%"
    assert "mfu" not in format_line(row(1, 1.0, mfu=None))
    assert format_line({**row(40, 3.0), "peak_mem_gib": 12.345}).endswith(
        "| mfu 25.00% | peak mem 12.3 GiB")


def test_peak_memory_only_on_cuda():
    assert peak_memory(torch.device("cpu")) == {}


def test_jsonl_rows_flushed_and_appended_across_loggers(tmp_path):
    off = WandbConfig(enabled=False)
    first = MetricsLogger(str(tmp_path), True, off, "r", {})
    first.log(row(1, 5.0))
    # flushed per row: readable before close
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 5.0
    first.close()
    second = MetricsLogger(str(tmp_path), True, off, "r", {})  # a resumed run appends
    second.log(row(2, 4.0))
    second.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 4.0


def test_non_zero_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path / "r1"), False, WandbConfig(enabled=True), "r", {})
    logger.log(row(1, 5.0))
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_wandb_offline_run_dir_holds_the_logged_keys(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(str(tmp_path), True, WandbConfig(enabled=True, mode="offline"), "tiny",
                           {"model": {"d_model": 32}})
    logger.log(row(1, 5.0))
    logger.log(row(2, 4.0))
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # wandb's service process may still be writing the file when finish() returns: wait for it.
    deadline = time.monotonic() + 60
    while b"tokens_per_s" not in (blob := runs[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for key in ("loss", "tokens_per_s", "mfu", "step_time_s", "depth", "d_model"):
        assert key.encode() in blob, key


def test_format_line_shows_the_loop_diagnostics():
    diag = {"diag/D_kept": 0.0123, "diag/anchor_over_scale": 1.2345, "diag/loop_gain": 0.25,
            "diag/D_norm_t0": 15.0}  # the rest go to metrics.jsonl only
    assert format_line({**row(40, 3.0, mfu=None), **diag}).endswith(
        "| step 50 ms | D_T/D_0 0.0123 | R/rho 1.23 | loop gain 0.25")
    # diagnostics off a log step: a row of its own, without the training fields
    assert format_line({"step": 7, **diag}) == \
        "step      7 | D_T/D_0 0.0123 | R/rho 1.23 | loop gain 0.25"
