"""Every command in the ```bash blocks of README.md and docs/*.md runs as written, in a temp dir
that looks like a checkout (configs/, launch/, slurm/ linked in), so a README that drifts from the
code fails here.

Each command (a line, or one `&&` part of a line) is either in RUN, which holds its exact README
text and runs it in dependency order, or in NOT_RUN with the reason it cannot run here. A bash
command in the README that is in neither fails `test_every_readme_command_is_run_or_listed`.

Sizes are shrunk only the ways the README says are the user's choice: trailing `key.sub=value`
overrides (steps, widths, sequence length, global batch, evaluation batches), `--vocab-size`, and the process
count of `--num_gpus`/`--nproc_per_node` (the README: the node's GPU count, on CPU the number of
processes). Launchers get a free `--master_port` so parallel test runs do not collide.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import TINY_VOCAB, tiny_documents
from scse_dist.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# Every page a user reads commands from: the README and the topic pages it links.
DOC_PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def doc_text() -> str:
    return "\n".join(page.read_text() for page in DOC_PAGES)

# gpt2-small shrunk to CPU size through trailing overrides (what the README offers for trying it).
GPT2_ON_CPU = (f"model.d_model=32 model.n_heads=2 model.vocab_size={TINY_VOCAB} "
               "model.max_seq_len=32 data.seq_len=32 train.batch.global_batch_tokens=4096 "
               "train.max_steps=3 train.warmup_steps=1 "
               "train.log_every=1 eval.batch_size=4 eval.max_batches=2")
QUICKSTART_STEPS = 30  # the README's shorter first look: train.max_steps=30 eval.max_batches=2

WIKITEXT = """ = Valkyria Chronicles III = 

 Senjō no Valkyria 3 is a tactical role playing video game developed by Sega . 
 The game began development in 2010 , carrying over a large portion of the work . 

 = = Gameplay = = 

 As with previous games , the player reads the story and follows the map . 

 = Tower Building of the Little Rock Arsenal = 

 The Tower Building of the Little Rock Arsenal is a building in the old park . 
"""  # noqa: W291 (WikiText's raw lines end in a space)
LAMBADA = ["the old man opened the door and looked at the cat . he smiled at the cat",
           "my sister paints a green box every day . today she paints the box",
           "the robot builds a quiet house in the park . it builds the house"]


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block: one per line, split at `&&`, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split(" && ")]
    return commands


def _metrics(run: Path) -> list[dict]:
    """The training rows (evaluation and sample rows carry a "kind")."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "kind" not in r]


def _results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _check_run(run: Path, steps: int, tokens_per_step: int, depths: list[int]) -> None:
    rows = _metrics(run)
    assert rows[-1]["step"] == steps and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["tokens"] == steps * tokens_per_step
    assert (run / "export" / "model.safetensors").is_file()
    assert [r["depth"] for r in _results(run / "eval" / "heldout.json")] == depths


def check_tokenizer(d: Path, out: str) -> None:
    import sentencepiece as spm

    assert spm.SentencePieceProcessor(model_file=str(d / "data/web/tokenizer.model")).vocab_size() \
        == TINY_VOCAB



def check_byte_bpe(d: Path, out: str) -> None:
    from scse_dist.data.tokenizer import Tokenizer

    tok = Tokenizer.load(str(d / "data/web/tokenizer.json"))
    assert (tok.kind, tok.vocab_size, tok.eos_id) == ("hf", TINY_VOCAB, 0)
    assert f"vocab {TINY_VOCAB}" in out

def check_shards(d: Path, out: str) -> None:
    index = json.loads((d / "data/web/shards/index.json").read_text())
    docs = {split: sum(s["documents"] for s in shards) for split, shards in index["splits"].items()}
    assert docs["train"] + docs["heldout"] == 2000 and docs["heldout"] > 0


def check_shards_2p(d: Path, out: str) -> None:
    one, two = d / "data/web/shards", d / "data/web/shards-2p"
    names = sorted(p.name for p in one.iterdir())
    assert sorted(p.name for p in two.iterdir()) == names and "index.json" in names
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names)  # same bytes
    assert "(2 processes): 2,000 documents" in out


def check_parquet_shards(d: Path, out: str) -> None:
    from scse_dist.data.tokenizer import Tokenizer

    index = json.loads((d / "data/fineweb/shards/index.json").read_text())
    docs = {split: sum(s["documents"] for s in shards) for split, shards in index["splits"].items()}
    assert docs["train"] + docs["heldout"] == PARQUET_DOCS and docs["heldout"] > 0
    # cut with the tokenizer.json the recipe names (its sha256 in the index), as an hf kind
    tok = Tokenizer.load(str(d / "data/gpt2/tokenizer.json"))
    assert tok.kind == "hf" and index["tokenizer_sha256"] == tok.sha256


def check_parquet_inspect(d: Path, out: str) -> None:
    assert f"OK: read {PARQUET_DOCS:,} documents" in out


def check_recipe_dry_run(d: Path, out: str) -> None:
    assert "global batch 512 seq (524288 tokens) = micro 16 x accum 2 x world 16" in out
    assert not (d / "runs").exists()


def check_inspect(d: Path, out: str) -> None:
    assert "OK: read 2,000 documents" in out


def check_dry_run(d: Path, out: str) -> None:
    assert "parameters: 1,180,544" in out and "tokens the run will see: 614,400" in out
    assert not (d / "runs").exists() and not (d / "data/quickstart").exists()  # nothing created


def check_print_config(d: Path, out: str) -> None:
    printed = yaml.safe_load(out)
    heldout_eval = printed["train"]["callbacks"]["heldout_eval"]
    assert printed["name"] == "quickstart" and heldout_eval["init_args"]["every_steps"] == 100
    assert not (d / "runs").exists()


def check_quickstart(d: Path, out: str) -> None:
    assert (d / "data/quickstart/shards/index.json").is_file()  # data.build made it
    _check_run(d / "runs/quickstart", QUICKSTART_STEPS, 16 * 128, [1, 2, 4, 8, 16, 32])
    assert list((d / "runs/quickstart/wandb").glob("offline-run-*"))


def check_quickstart_t8(d: Path, out: str) -> None:
    run = d / "runs/quickstart-T8"
    assert "steps 0..5" in out  # its own run, not a resume of runs/quickstart
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["depth"] == 8
    _check_run(run, 5, 16 * 128, [1, 2, 4, 8, 16, 32])


def check_gpt2_two_ranks(d: Path, out: str) -> None:
    run = d / "runs/gpt2-small-scse"
    assert "world 2 (env), ZeRO-1" in out
    ran = yaml.safe_load((run / "config.yaml").read_text())["train"]
    # the config's own relative path, resolved against its directory (docs/config.md)
    assert ran["batch"]["grad_accum_steps"] == 4 and \
        Path(ran["engine"]["deepspeed_config"]).resolve() == \
        (d / "configs/deepspeed/zero1.json").resolve()
    # every rank consumed micro 16 x accumulation 4 sequences of 32 tokens per step: the
    # 4096-token global batch over 2 ranks
    assert "global batch 128 seq (4096 tokens) = micro 16 x accum 4 x world 2" in out
    _check_run(run, 3, 2 * 16 * 4 * 32, [1, 2, 4, 8, 16, 32, 48])


def check_gpt2_dry_run(d: Path, out: str) -> None:
    # the shipped 0.5M-token batch, split over the 16 GPUs of the config's resources:
    assert "global batch 512 seq (524288 tokens) = micro 16 x accum 2 x world 16" in out
    assert "steps: 20,000, tokens the run will see: 10,485,760,000" in out
    assert not (d / "runs").exists()


def check_eval(name: str, depths: list[int], metric: str) -> Callable[[Path, str], None]:
    def check(d: Path, out: str) -> None:
        rows = _results(d / name)
        assert [r["depth"] for r in rows] == depths
        assert all(math.isfinite(r[metric]) for r in rows)
    return check


def check_eval_exit(d: Path, out: str) -> None:
    [row] = _results(d / "exit.json")
    assert row["depth"] == 32 and row["exit"] == "motion:0.02"  # the cap: the config's deepest
    assert 1 <= row["mean_steps"] <= 32 and sum(row["steps_histogram"].values()) == row["tokens"]
    assert math.isfinite(row["ppl"]) and "mean_steps" in out


def check_export(d: Path, out: str) -> None:
    from safetensors.torch import load_file

    from scse_dist.hf import hf_file_names

    ours, trainers = d / "quickstart-export", d / "runs/quickstart/export"
    names = sorted(["config.yaml", "model.safetensors", "tokenizer.model", *hf_file_names(True)])
    assert sorted(p.name for p in ours.iterdir()) == \
        sorted(p.name for p in trainers.iterdir()) == names
    for name in ("config.json", "modeling_scse.py"):  # scse-export's HF files are the trainer's
        assert (ours / name).read_bytes() == (trainers / name).read_bytes(), name
    assert (ours / "tokenizer.model").read_bytes() == \
        (d / "data/quickstart/tokenizer.model").read_bytes()
    assert (ours / "config.yaml").read_text() == (trainers / "config.yaml").read_text()
    a = load_file(str(ours / "model.safetensors"))
    b = load_file(str(trainers / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def check_lm_eval(d: Path, out: str) -> None:
    (results,) = (d / "lm-eval").rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]
    assert 0 <= metrics["scse_lambada"]["acc,none"] <= 1
    assert math.isfinite(metrics["scse_wikitext"]["word_perplexity,none"])
    # the same files through scse-eval (its lambada.json, at depths 1..32, holds depth 8)
    ours = next(r for r in _results(d / "lambada.json") if r["depth"] == 8)
    assert metrics["scse_lambada"]["acc,none"] == ours["accuracy"]
    assert metrics["scse_lambada"]["perplexity,none"] == pytest.approx(ours["ppl"], rel=1e-6)


def check_generate(d: Path, out: str) -> None:
    # the prompt, then the continuation (this test's 30-step model may sample EOS early: what
    # generation prints is tested in tests/test_generate.py and tests/test_speculative.py)
    assert out.startswith("Return the") and out.endswith("\n")


def check_report(d: Path, out: str) -> None:
    report = (d / "reports/quickstart/report.md").read_text()
    assert "quickstart-T8" in report and "heldout" in report
    assert (d / "reports/quickstart/frontier.png").stat().st_size > 0
    assert list((d / "reports/quickstart/wandb").glob("offline-run-*"))


def check_launch_local(d: Path, out: str) -> None:
    run = d / "runs/tiny-cpu"
    for task in ("heldout", "diagnose"):  # its eval.tasks
        assert [r["depth"] for r in _results(run / "eval" / f"{task}.json")] == [1, 2, 4]
    assert (run / "eval/report.md").is_file()


@dataclass
class Step:
    command: str  # exactly as in README.md
    check: Callable[[Path, str], None]
    edits: tuple[tuple[str, str], ...] = ()  # (README text, what runs here); each must occur
    append: str = ""  # trailing size arguments
    fresh: tuple[str, ...] = ()  # removed first: an alternative to an earlier command, not a resume


def launcher_port(launcher: str) -> tuple[str, str]:
    return (f"{launcher} ", f"{launcher} --master_port {free_port()} ")


# In dependency order (the gpt2-small launchers need data/web from the Data section).
RUN = [
    Step("scse-data tokenizer --input 'corpus/*.jsonl.gz' --vocab-size 32000 --out data/web/tokenizer.model",
         check_tokenizer, edits=(("--vocab-size 32000", f"--vocab-size {TINY_VOCAB}"),)),
    Step("scse-data tokenizer --kind byte-bpe --input 'corpus/*.jsonl.gz' --vocab-size 32000 --out data/web/tokenizer.json",
         check_byte_bpe, edits=(("--vocab-size 32000", f"--vocab-size {TINY_VOCAB}"),)),
    Step("scse-data shards --input 'corpus/*.jsonl.gz' --tokenizer data/web/tokenizer.model --out data/web/shards --heldout-fraction 0.005",
         check_shards),
    Step("scse-data shards --input 'corpus/*.jsonl.gz' --tokenizer data/web/tokenizer.model --out data/web/shards-2p --heldout-fraction 0.005 --processes 2",
         check_shards_2p),
    Step("scse-data inspect data/web/shards", check_inspect),
    # docs/data.md's recipe; a held-out share of 5%, not 0.1%, so 600 documents hold out some
    Step("scse-data shards --input 'fineweb/*.parquet' --text-field text --tokenizer data/gpt2/tokenizer.json --out data/fineweb/shards --heldout-fraction 0.001 --processes 2",
         check_parquet_shards, edits=(("--heldout-fraction 0.001", "--heldout-fraction 0.05"),)),
    Step("scse-data inspect data/fineweb/shards", check_parquet_inspect),
    Step("scse-train --config configs/gpt2-small-scse.yaml --dry-run --world-size 16 name=gpt2-small-scse-fineweb data.path=data/fineweb/shards data.tokenizer=data/gpt2/tokenizer.json model.vocab_size=50304",
         check_recipe_dry_run),
    Step("python launch/train.py --config configs/quickstart.yaml --dry-run", check_dry_run),
    Step("scse-train --config configs/gpt2-small-scse.yaml --dry-run --world-size 16",
         check_gpt2_dry_run),
    Step("python launch/train.py --config configs/quickstart.yaml --print-config",
         check_print_config),
    Step("python launch/train.py --config configs/quickstart.yaml", check_quickstart,
         append=f"train.max_steps={QUICKSTART_STEPS} eval.max_batches=2"),
    Step("python launch/train.py --config configs/quickstart.yaml name=quickstart-T8 model.depth=8 train.max_steps=50",
         check_quickstart_t8, append="train.max_steps=5 eval.max_batches=2"),
    Step("deepspeed --num_gpus 8 launch/train.py --config configs/gpt2-small-scse.yaml",
         check_gpt2_two_ranks, edits=(("--num_gpus 8", "--num_gpus 2"),), append=GPT2_ON_CPU,
         fresh=("runs/gpt2-small-scse",)),
    Step("torchrun --nproc_per_node 8 launch/train.py --config configs/gpt2-small-scse.yaml",
         check_gpt2_two_ranks, edits=(("--nproc_per_node 8", "--nproc_per_node 2"),),
         append=GPT2_ON_CPU, fresh=("runs/gpt2-small-scse",)),
    Step("scse-eval --checkpoint runs/quickstart/export --task heldout --data data/quickstart/shards --depths 1,8,48 --out results.json",
         check_eval("results.json", [1, 8, 48], "ppl")),
    Step("scse-eval --checkpoint runs/quickstart/export --task wikitext --data wikitext-103-raw/wiki.test.raw --out wikitext.json",
         check_eval("wikitext.json", [1, 2, 4, 8, 16, 32], "word_ppl")),
    Step("scse-eval --checkpoint runs/quickstart/export --task lambada --data lambada_test.jsonl --out lambada.json",
         check_eval("lambada.json", [1, 2, 4, 8, 16, 32], "accuracy")),
    Step("scse-eval --checkpoint runs/quickstart/export --task hellaswag --data hellaswag_val.jsonl --out hellaswag.json",
         check_eval("hellaswag.json", [1, 2, 4, 8, 16, 32], "acc_norm")),
    Step("scse-eval --checkpoint runs/quickstart/checkpoints --task diagnose --depths 1,8,48 --out diagnose.json",
         check_eval("diagnose.json", [1, 8, 48], "deviation_norm")),
    Step("scse-eval --checkpoint runs/quickstart/export --task heldout --data data/quickstart/shards --exit motion:0.02 --out exit.json",
         check_eval_exit),
    Step("scse-export runs/quickstart --out quickstart-export", check_export),
    Step("scse-lm-eval --model scse --model_args pretrained=runs/quickstart/export,depth=8 --tasks scse_lambada,scse_wikitext --metadata lambada=lambada_test.jsonl wikitext=wikitext-103-raw/wiki.test.raw --output_path lm-eval",
         check_lm_eval),
    Step('scse-generate runs/quickstart/export --prompt "Return the" --max-new-tokens 40 --temperature 0.8 --top-p 0.95 --seed 1',
         check_generate),
    Step('scse-generate runs/quickstart/export --prompt "Return the" --max-new-tokens 40 --depth 8 --speculative 1,4',
         check_generate),
    Step('scse-generate runs/quickstart/export --prompt "Return the" --max-new-tokens 40 --depth 8 --speculative 1,auto',
         check_generate),
    Step("scse-report runs/quickstart runs/quickstart-T8 --out reports/quickstart --wandb offline",
         check_report),
    Step("scse-launch configs/tiny-cpu.yaml --local", check_launch_local),
]

ENVIRONMENT = "sets up the environment this test runs in"
SLURM = ("needs a Slurm cluster; tests/test_slurm_e2e.py runs scse-launch on a real local Slurm, "
         "from a directory outside the checkout")
STUDY = ("a study trains dozens of runs (minutes to days); tests/test_study.py runs --dry-run and "
         "--local on tiny specs, tests/test_study_slurm.py --slurm, and parses both shipped specs")
LOCAL_CLUSTER = ("the CPU-cluster study walkthrough starts the machine-wide local Slurm; "
                 "tests/test_study_slurm.py runs the same on the tests' own cluster (spec "
                 "defaults, no --backend-args, the cap, evaluations in the job, the report)")
SHARED = "reads the public text samples of docs/studies.md, which the tests do not download"
PARTS = ("a Slurm array of parts and its merge; tests/test_data_parts.py runs parts 0..N-1 and "
         "`scse-data merge` and compares every file with one process's, byte for byte")
IMPORT = ("tests/test_data_import.py runs docs/data.md's import and inspect as written, on small "
          "llm.c files of GPT-2's layout")
PRETRAINED = ("starts from a hub checkpoint (no network here); tests/test_pretrained_e2e.py runs "
              "the recipe's steps as commands on tiny saved Llama and Qwen3 models (import, "
              "retrofit, shards with the export's tokenizer, 10 steps from a base: config under "
              "ZeRO-1 and ZeRO-3, scse-eval at T = 1, 2, 4), and tests/test_convert_hf.py runs "
              "to-hf")
NOT_RUN = {
    "scse-convert from-hf HuggingFaceTB/SmolLM2-135M --out exports/smollm2": PRETRAINED,
    "scse-convert retrofit exports/smollm2 --out exports/smollm2-scse --recurrence scse":
        PRETRAINED,
    "scse-data shards --input 'data/*.jsonl.gz' --tokenizer exports/smollm2/tokenizer.json --out data/smollm2/shards":
        PRETRAINED,
    "scse-train --config smollm2-scse.yaml": PRETRAINED,
    "scse-eval --checkpoint runs/smollm2-scse/export --task heldout --data data/smollm2/shards --depths 1,2,4,8 --out depths.json":
        PRETRAINED,
    "scse-convert to-hf exports/smollm2 --out hf/smollm2": PRETRAINED,
    # docs/data.md's recipe: write_inputs puts a byte-level BPE in GPT-2's format at the path
    "mkdir -p data/gpt2": "write_inputs makes data/gpt2 and writes tokenizer.json there",
    "curl -L -o data/gpt2/tokenizer.json https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json":
        "downloads GPT-2's tokenizer (no network here); write_inputs trains a small byte-level "
        "BPE of the same format at that path, and tests/test_tokenizer_kinds.py checks the kind",
    "sbatch --nodes=2 slurm/pretrain.sh configs/gpt2-small-scse.yaml name=gpt2-small-scse-fineweb data.path=data/fineweb/shards data.tokenizer=data/gpt2/tokenizer.json model.vocab_size=50304":
        "needs a Slurm cluster of GPUs; tests/test_slurm_pretrain.py sbatches slurm/pretrain.sh "
        "on a real local Slurm, from a directory outside the checkout",
    # the planner at gpt2-medium size: tests/test_plan.py runs --plan through the CLI (table, JSON)
    "scse-train --config configs/gpt2-small-scse.yaml --plan --world-size 16 --gpu h200 --tokens 10e9      name=gpt2-medium-scse model.d_model=1024 model.n_heads=16 model.n_core=5 model.depth=16      train.engine.zero_stage=2 train.engine.deepspeed_config=configs/deepspeed/zero2.json":
        "sizes a run of 10B tokens; tests/test_plan.py runs scse-train --plan the same way",
    "python launch/train.py --config configs/quickstart.yaml name=stable train.schedule.kind=constant      train.max_steps=10000 train.checkpoint.every=1000 train.checkpoint.keep=20":
        "10,000 training steps; tests/test_train_cooldown.py trains a constant-LR run and branches it",
    "python launch/train.py --config configs/quickstart.yaml name=stable-cool4k train.schedule.kind=wsd      train.max_steps=5000 train.schedule.decay_steps=1000      train.start.branch_from=runs/stable/checkpoints/step-0004000":
        "branches the 10,000-step run above; tests/test_train_cooldown.py branches a cooldown the same way",
    "scse-study configs/studies/repro-cpu.yaml --dry-run": STUDY,
    "scse-study configs/studies/repro-cpu.yaml --local": STUDY,
    "scse-study configs/studies/gpt2-small.yaml --slurm --max-parallel 4": STUDY,
    "scse-study configs/studies/repro-cpu.yaml --variants scse-preln,additive-preln --local":
        "a piece of a study; tests/test_study_pieces.py runs a tiny study in two pieces",
    "scse-study configs/studies/repro-cpu.yaml --report":
        "tests/test_study_pieces.py runs --report over a tiny study's pieces",
    "scse-data fetch-eval --manifest configs/eval/gpu.json --out data/eval-gpu":
        "downloads from the Hub (no network here); tests/test_fetch_eval.py runs it on a local "
        "mirror (--source)",
    "bash slurm/local-cluster.sh start": LOCAL_CLUSTER,
    "scse-data quickstart --out data/tiny-cpu --vocab-size 512 --heldout-fraction 0.05": LOCAL_CLUSTER,
    "scse-study configs/studies/cpu-cluster.yaml --dry-run": LOCAL_CLUSTER,
    "scse-study configs/studies/cpu-cluster.yaml --slurm --max-parallel 2": LOCAL_CLUSTER,
    "squeue -o '%.8i %.26j %.8T %.8M %R'": LOCAL_CLUSTER,
    "cat studies/cpu-cluster/report/report.md": LOCAL_CLUSTER,
    "scse-data tokenizer --input data/public/c4_en_train00000_first1000.jsonl --vocab-size 4096 --out data/webtext/tokenizer.model": SHARED,
    "scse-data shards --input data/public/c4_en_train00000_first1000.jsonl --tokenizer data/webtext/tokenizer.model --out data/webtext/shards --heldout-fraction 0.05": SHARED,
    "mkdir -p data/eval": SHARED,
    "mkdir -p data/public": SHARED,
    "curl -L https://huggingface.co/datasets/allenai/c4/resolve/main/en/c4-train.00000-of-01024.json.gz | gunzip | head -n 1000 > data/public/c4_en_train00000_first1000.jsonl":
        "downloads C4 from the Hugging Face Hub (no network here)",
    "scse-data shards --input hf:wikitext:wikitext-103-raw-v1:train --tokenizer data/web/tokenizer.model --out data/wikitext/shards":
        "streams from the Hugging Face Hub (no network here); tests/test_data_columnar.py reads a "
        "save_to_disk directory and parquet through the same row accounting",
    "scse-data import --format llm-c-bin fineweb10B/fineweb_val_000000.bin 'fineweb10B/fineweb_train_*.bin' --tokenizer data/gpt2/tokenizer.json --out data/fineweb-bin/shards --heldout-fraction 0.001":
        IMPORT,
    "scse-data inspect data/fineweb-bin/shards": IMPORT,
    "sbatch --array=0-63 --wrap 'scse-data shards --input \"corpus/*.parquet\" --tokenizer data/web/tokenizer.model --out s3://bucket/web --part $SLURM_ARRAY_TASK_ID/64'": PARTS,
    "sbatch --dependency=afterok:ARRAY_JOB_ID --wrap 'scse-data merge s3://bucket/web'": PARTS,
    "head -c 50000 data/public/openwebtext_sample.txt > data/eval/owt-valid.txt": SHARED,
    "head -c 20000 data/public/wiki.valid.raw > data/eval/wiki.valid.raw": SHARED,
    "head -n 100 data/public/lambada_development_plain_text.txt > data/eval/lambada-dev.txt": SHARED,
    "python3 -m venv .venv": ENVIRONMENT,
    ". .venv/bin/activate": ENVIRONMENT,
    "pip install torch==2.13.0 setuptools wheel": ENVIRONMENT,
    "pip install --no-build-isolation -e '.[dev]'": ENVIRONMENT,
    "pip install -e '.[lm-eval]'": ENVIRONMENT + " (the dev extra includes lm-eval)",
    "lm_eval --model hf --model_args pretrained=runs/quickstart/export,trust_remote_code=True --include_path scse_dist/lmeval/tasks --tasks scse_lambada --metadata lambada=lambada_test.jsonl --device cpu":
        "lm-eval's hf model needs accelerate (lm_eval[hf]); tests/test_lmeval.py runs it on a "
        "tiny export against --model scse (test_hf_model_agrees_with_scse_model)",
    "python launch/train.py --config configs/quickstart.yaml train.start.resume_from=step-100":
        "the test's quickstart runs 30 steps (no step-100); tests/test_train_resume.py resumes a "
        "real run from a chosen tag (test_resume_from_a_chosen_tag_moves_the_newer_ones_aside)",
    "python launch/train.py --config configs/quickstart.yaml tensorboard.enabled=true":
        "the 300-step quickstart with TensorBoard on; tests/test_train_tensorboard.py trains a "
        "tiny run with it and reads the event files back against metrics.jsonl",
    "tensorboard --logdir runs/quickstart/tensorboard":
        "TensorBoard's web server runs until stopped; tests/test_train_tensorboard.py reads the "
        "event files with TensorBoard's own loader (EventAccumulator)",
    "python launch/train.py --config configs/quickstart.yaml train.callbacks.profiler.enabled=true train.callbacks.profiler.init_args.start_step=20 model.activation_checkpointing=loop":
        "the 300-step quickstart, profiled; tests/test_train_tensorboard.py profiles a tiny run "
        "under loop checkpointing and reads its trace's loop-step labels",
    "python benchmarks/replay_collapse.py --run runs/NAME --from-step 20 --steps 15":
        "needs a run that collapsed (runs/NAME); tests/test_replay_collapse.py replays a tiny "
        "run's checkpoint the same way",
    "pytest": "runs the test suite's fast tier",
    "pytest -m slow": "runs the test suite's slow tier, this test included",
    "scse-launch configs/gpt2-small-scse.yaml": SLURM,
    "sbatch --nodes=4 slurm/pretrain.sh configs/gpt2-small-scse.yaml":
        "needs a Slurm cluster with GPUs; tests/test_slurm_pretrain.py sbatches slurm/pretrain.sh "
        "on a real local Slurm (2 CPU tasks, a tiny config) from a directory outside the checkout",
    "sbatch slurm/eval.sh --checkpoint runs/NAME/export --task lambada --data lambada_test.jsonl --out x.json":
        SLURM,
}


def test_every_readme_command_is_run_or_listed():
    commands = readme_commands(doc_text())
    run = [s.command for s in RUN]
    unknown = [c for c in commands if c not in run and c not in NOT_RUN]
    assert not unknown, \
        f"README/docs commands neither run by this test nor listed in NOT_RUN: {unknown}"
    gone = [c for c in [*run, *NOT_RUN] if c not in commands]
    assert not gone, f"commands this test expects that README.md and docs/ no longer have: {gone}"
    assert len(set(run)) == len(run)
    # The shorter quickstart the tests run is the one the README offers.
    quickstart = next(s for s in RUN if s.check is check_quickstart)
    assert f"{quickstart.command} {quickstart.append}" in README.read_text()


PARQUET_DOCS = 600


def write_inputs(d: Path) -> None:
    """The files the README's commands read, at the README's paths, in the formats it states."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scse_dist.data.tokenizer_hf import train_byte_bpe

    (d / "fineweb").mkdir()
    fineweb = tiny_documents(PARQUET_DOCS, seed=1)
    for part in range(2):  # FineWeb's own columns, the text among them
        rows = fineweb[part::2]
        pq.write_table(pa.table({"text": rows, "id": [f"doc-{part}-{i}" for i in range(len(rows))]}),
                       d / f"fineweb/part-{part:05d}.parquet", row_group_size=100)
    (d / "data/gpt2").mkdir(parents=True)
    train_byte_bpe(fineweb, TINY_VOCAB, str(d / "data/gpt2/tokenizer.json"))
    (d / "corpus").mkdir()
    docs = tiny_documents(2000)
    for part in range(2):
        with gzip.open(d / f"corpus/part-{part:02d}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs[part::2])
    (d / "wikitext-103-raw").mkdir()
    (d / "wikitext-103-raw/wiki.test.raw").write_text(WIKITEXT)
    (d / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    (d / "hellaswag_val.jsonl").write_text("".join(  # HellaSwag's own fields
        json.dumps({"activity_label": "Story", "ctx_a": t.rsplit(" the ", 1)[0], "ctx_b": "",
                    "endings": ["the " + t.rsplit(" the ", 1)[1], "a blue sky", "the end"],
                    "label": 0}) + "\n" for t in LAMBADA))


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, user_env):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("configs", "launch", "slurm"):
        (checkout / name).symlink_to(REPO / name)
    write_inputs(checkout)
    commands = readme_commands(doc_text())
    for step in RUN:
        assert step.command in commands, f"README.md and docs/ no longer have: {step.command}"
        line = step.command
        for old, new in step.edits + ((launcher_port(line.split()[0]),)
                                      if line.split()[0] in ("deepspeed", "torchrun") else ()):
            assert old in line, (step.command, old)
            line = line.replace(old, new, 1)
        line = f"{line} {step.append}".strip()
        for path in step.fresh:
            shutil.rmtree(checkout / path, ignore_errors=True)
        cpu, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        out = subprocess.run(["bash", "-c", line], cwd=checkout, env=user_env, capture_output=True,
                             text=True, timeout=400)
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the command and its processes (wall time depends on what else runs)
        print(f"{used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime:6.1f} s CPU "
              f"{time.perf_counter() - wall:6.1f} s wall  {line[:90]}")
        assert out.returncode == 0, \
            f"{line}\nrc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
        try:
            step.check(checkout, out.stdout)
        except AssertionError as exc:
            raise AssertionError(f"{line}: {exc}\n{out.stdout[-3000:]}") from exc
