"""Out of space in whole commands, run as real processes: a file-size limit (RLIMIT_FSIZE, which a
full disk or a quota meets the same way: the write fails) and an injected failed write
(SCSE_FAULT_NO_SPACE) at every writer. Each exits 74 with one line naming the path and the free
space, leaves the previous output as it was, and a training run resumes exactly afterwards."""

from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import console_script
from scse_dist.atomic import NO_SPACE_FAULT_ENV
from scse_dist.config import config_from_dict
from scse_dist.eval.results import write_results
from train_procs import REPO, TRAIN, read_metrics

pytestmark = pytest.mark.slow

NO_SPACE = 74  # scse_dist.cli_errors.EXIT_NO_SPACE
STEPS = ("train.max_steps=9", "train.checkpoint.every=3", "train.log_every=1")
# The tiny config's checkpoint: model states 268 kB, optimizer states 734 kB (ZeRO-1, fp32).
FITS_MODEL_NOT_OPTIMIZER = 500_000
ONE_LINE = r"^{prog}: no space left writing {path}: \d+(\.\d)? (B|kB|MB|GB|TB) free on that file " \
    r"system \(a full disk, a quota or a file-size limit\); free space and rerun the same " \
    r"command{tail}$"


def _limited(fsize: int):
    def apply() -> None:  # SIGXFSZ ignored (as Python does): the write fails with EFBIG instead
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


def run(cmd: list[str], env: dict, fsize: int | None = None, fault: str | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`cmd` under a file-size limit `fsize` or with the failed write `fault` (or neither)."""
    env = dict(env, **{NO_SPACE_FAULT_ENV: fault} if fault else {})
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=_limited(fsize) if fsize else None)


def assert_refused(proc: subprocess.CompletedProcess, prog: str, path: str, tail: str = ""):
    """Exit 74 and one line naming `path` (a regex) and the free space, last on stderr (after the
    progress lines), no traceback."""
    assert proc.returncode == NO_SPACE, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()  # progress lines, then the one line
    assert "Traceback" not in proc.stderr and [line for line in lines
                                               if line.startswith(f"{prog}:")] == lines[-1:]
    assert re.match(ONE_LINE.format(prog=prog, path=path, tail=tail), lines[-1]), proc.stderr


def listing(root: Path) -> dict[str, str]:
    """Every path under `root`: a file's sha256, or "dir" for a folder."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


def weights(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "export" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config, subprocess_env) -> Path:
    """An uninterrupted run of STEPS: the weights the others must reach, and inputs to the
    commands after training (its export, checkpoints and eval)."""
    root = tmp_path_factory.mktemp("trained")
    proc = run([sys.executable, TRAIN, "--config", tiny_config(root, *STEPS)], subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "runs" / "tiny"


def test_a_checkpoint_that_does_not_fit_keeps_the_last_and_the_run_resumes_exactly(
        tmp_path, tiny_config, subprocess_env, trained):
    train = [sys.executable, TRAIN, "--config", tiny_config(tmp_path, *STEPS)]
    run_dir = tmp_path / "runs" / "tiny"
    ckpts = run_dir / "checkpoints"
    # 1. An injected failed write in the middle of step 6's save: step-3 stays `latest`.
    proc = run(train, subprocess_env, fault="*/.tmp-step-0000006/*optim_states.pt")
    tmp_file = re.escape(str(ckpts / ".tmp-step-0000006")) + "/.*optim_states.pt"
    assert_refused(proc, "scse-train", tmp_file, tail=r" \(it resumes from step-0000003\)")
    assert (ckpts / "latest").read_text() == "step-0000003"
    kept = listing(ckpts / "step-0000003")
    assert not list(ckpts.glob(".tmp-*")) and not (ckpts / "step-0000006").exists()
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    # 2. The rerun under a file-size limit: resumed at step 3, torch.save's write of step 6's
    # optimizer states fails for real (EFBIG, which torch reports as a RuntimeError).
    proc = run(train, subprocess_env, fsize=FITS_MODEL_NOT_OPTIMIZER)
    assert_refused(proc, "scse-train", tmp_file, tail=r" \(it resumes from step-0000003\)")
    assert (ckpts / "latest").read_text() == "step-0000003"
    assert listing(ckpts / "step-0000003") == kept and not list(ckpts.glob(".tmp-*"))
    # 3. Space freed: the same command resumes and ends where the uninterrupted run ended.
    proc = run(train, subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 3 (data stream and RNG restored)" in proc.stdout
    assert weights(run_dir) == weights(trained)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 10))


@pytest.mark.parametrize("fsize, fault", [(None, "*/runs/tiny/export"), (150_000, None)])
def test_the_export_that_does_not_fit_is_written_by_the_rerun(tmp_path, tiny_config,
                                                              subprocess_env, trained, fsize,
                                                              fault):
    train = [sys.executable, TRAIN, "--config", tiny_config(tmp_path, *STEPS)]
    run_dir = tmp_path / "runs" / "tiny"
    if fsize:  # the checkpoints first, then the export alone under the limit
        proc = run(train, subprocess_env, fault="*/runs/tiny/export")
        assert proc.returncode == NO_SPACE, proc.stderr[-3000:]
    proc = run(train, subprocess_env, fsize=fsize, fault=fault)
    where = re.escape(str(run_dir / "export")) + ("" if fault else "/.*model.safetensors")
    assert_refused(proc, "scse-train", where, tail=r" \(it resumes from step-0000009\)")
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000009"
    assert not (run_dir / "export").exists() and not list(run_dir.glob(".tmp-*"))
    proc = run(train, subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weights(run_dir) == weights(trained)


@pytest.mark.parametrize("fsize, fault", [(5_000, None), (None, "*/metrics.jsonl@5")])
def test_a_metrics_row_that_does_not_fit(tmp_path, tiny_config, subprocess_env, fsize, fault):
    # Under the limit: row 3 (rows are ~2 kB) fails before any checkpoint, and the run leaves
    # nothing (the run dir was its own). Injected: row 5, after step-3 was saved.
    train = [sys.executable, TRAIN, "--config", tiny_config(tmp_path, *STEPS)]
    run_dir = tmp_path / "runs" / "tiny"
    proc = run(train, subprocess_env, fsize=fsize, fault=fault)
    assert_refused(proc, "scse-train", re.escape(str(run_dir / "metrics.jsonl")))
    if fsize:
        assert not (tmp_path / "runs").exists()
    else:
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]  # whole rows only
        assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000003"


def _corpus(root: Path) -> Path:
    from conftest import tiny_documents

    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in tiny_documents(200)))
    return corpus


# Each writer after training: (the command, the output it writes again; {root}: a folder with the
# trained run as run/, a corpus and its tokenizer), a file-size limit its output does not fit
WRITERS = {
    "shards": (["scse-data", "shards", "--input", "{root}/corpus.jsonl", "--tokenizer",
                "{root}/tok.model", "--out", "{root}/out"], 2_000),
    "shards-in-parts": (["scse-data", "shards", "--input", "{root}/corpus.jsonl", "--tokenizer",
                         "{root}/tok.model", "--out", "{root}/out", "--processes", "2"], 2_000),
    "export": (["scse-export", "{root}/run", "--out", "{root}/out"], 150_000),
    "eval": (["scse-eval", "--checkpoint", "{root}/run/export", "--task", "heldout", "--data",
              "{root}/run/shards", "--depths", "1,2", "--max-batches", "2", "--out",
              "{root}/out/heldout.json"], 300),
    "report": (["scse-report", "{root}/run", "--out", "{root}/out", "--wandb", "disabled"], 300),
}


@pytest.mark.parametrize("limited", [True, False], ids=["rlimit", "injected"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_commands_output_that_does_not_fit_leaves_the_previous_one(
        tmp_path, trained, tiny_data, user_env, writer, limited):
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints"))
    shutil.copytree(trained / "checkpoints", tmp_path / "run" / "checkpoints", symlinks=True)
    shutil.copytree(tiny_data["path"], tmp_path / "run" / "shards")
    shutil.copyfile(tiny_data["tokenizer"], tmp_path / "tok.model")
    _corpus(tmp_path)
    write_results(tmp_path / "run" / "eval" / "heldout.json", "heldout", "tiny@step-0000009",
                  config_from_dict({"name": "tiny"}),
                  [{"depth": t, "loss": 5.0, "ppl": 150.0 - t, "tokens": 64} for t in (1, 2)])
    args, fsize = WRITERS[writer]
    prog, *rest = args
    cmd = [*console_script(prog), *(a.format(root=tmp_path) for a in rest)]
    first = run(cmd, user_env, cwd=tmp_path)  # the previous good output
    assert first.returncode == 0, first.stderr[-3000:]
    before = listing(tmp_path)
    proc = run(cmd, user_env, cwd=tmp_path, fsize=fsize if limited else None,
               fault=None if limited else f"{tmp_path}/out*")
    where = "out"
    if writer == "shards-in-parts" and limited:  # a part's line (in the folder being built), then
        # the whole command's (the injected fault matches the output only: the command's one line)
        assert re.fullmatch(r"scse-data: error: part [01]/2 exited 74; the other parts were "
                            r"stopped\n", proc.stderr.splitlines(True)[-1]), proc.stderr
        proc.stderr = "".join(proc.stderr.splitlines(True)[:-1])
        where = r"\.tmp-out\.[^/]+\.\d+/parts/part-0000[01]-of-00002"
    assert_refused(proc, prog, re.escape(str(tmp_path)) + f"/{where}.*")
    assert listing(tmp_path) == before
