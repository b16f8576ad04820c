"""The lm-evaluation-harness model `scse`: an export scored with the project's own scorer.

    --model scse --model_args pretrained=EXPORT,depth=T,exit=fixed,batch_size=B,device=cpu

Its model args are listed in `scse-lm-eval --help` (scse_dist.lmeval.cli). Requests are windows
as scse-eval forms them (scse_dist.eval.scoring): (context, continuation) is EOS + context +
continuation cut from the left to max_length inputs; a rolling request is the document's sliding
windows. So scse-eval and lm-eval agree to rounding on the same data.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, cast

# lm-eval's own models: its registry loads them only when it is empty, which registering `scse`
# first would make it never be
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.inputs import load_tokenizer
from scse_dist.eval.scoring import (
    Score,
    Window,
    context_target_window,
    documents_windows,
    score_windows,
)
from scse_dist.eval.task_run import context_target_ids
from scse_dist.generate import Sampling, generate, next_tokens
from scse_dist.lmeval import MODEL_NAME
from scse_dist.model.exit_rules import ExitRule, parse_exit_rule
from scse_dist.progress import Progress


class ExitScorer:
    """Loop depth for the harness's requests: `depth` steps per token, or an exit rule's adaptive
    depth capped at `depth` (the rule's max= overrides the cap), scored as scse-eval scores.
    Steps used are counted per lm-eval task (`steps_summary`)."""

    def __init__(self, depth: int, rule: Optional[ExitRule] = None):
        self.depth = depth
        self.rule = rule
        self.stats: dict[str, ExitStats] = {}  # task name -> steps of its scored tokens

    def score(self, model: torch.nn.Module, windows: list[Window], batch_size: int,
              task: str = "", progress: Optional[Progress] = None) -> list[Score]:
        stats = None if self.rule is None else self.stats.setdefault(task, ExitStats(self.rule))
        return score_windows(model, windows, [self.depth], batch_size, stats, progress)[1][0]

    def next_logits(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """(B, V) logits for the token after each row of `tokens` (B, S)."""
        depth = self.depth if self.rule is None else self.rule.cap(self.depth)
        return model(tokens, depth=depth, exit_rule=self.rule).logits[:, -1].float()

    def steps_summary(self) -> dict:
        """{task: ExitStats.summary()} of the scored loglikelihood tokens; empty at fixed depth."""
        return {task: stats.summary() for task, stats in sorted(self.stats.items())}

    def __repr__(self) -> str:
        return f"ExitScorer(depth={self.depth}, exit={self.rule or 'fixed'})"


def exit_scorer(text: str, depth: int, options: Optional[dict] = None) -> ExitScorer:
    """The scorer of the `exit=` model arg, as scse-eval --exit takes it ("fixed": fixed depth).
    lm-eval splits --model_args at commas, so `exit=motion:0.02,min=2,max=8` arrives as
    exit="motion:0.02" and the model args min=2, max=8: `options` joins them back."""
    unknown = sorted(set(options or {}) - {"min", "max"})
    if unknown:
        raise ValueError(f"unknown model args {', '.join(unknown)} (the exit rule's options are "
                         "min= and max=)")
    text = ",".join([str(text), *(f"{k}={v}" for k, v in (options or {}).items())])
    rule = parse_exit_rule(text)
    if rule.kind == "fixed" and rule.max_steps is not None:
        raise ValueError(f"exit={text!r}: fixed runs `depth` steps; set depth= instead of max=")
    return ExitScorer(depth, None if rule.kind == "fixed" else rule)


def _int_arg(name: str, value: Any) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected a positive integer") from None
    if number < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return number


@register_model(MODEL_NAME)
class ScseLM(LM):
    def __init__(self, pretrained: str, depth: Any = None, exit: str = "fixed",
                 batch_size: Any = None, max_length: Any = None, stride: Any = None,
                 device: Optional[str] = None, max_batch_size: Any = None, **exit_options: Any):
        super().__init__()
        from scse_dist.checkpoint.export import local_export
        from scse_dist.checkpoint.loading import checkpoint_config, load_model

        # lm-eval's CLI passes batch_size, max_batch_size and device to every model; automatic
        # batch sizing (auto, max_batch_size) is not supported: auto means the config's size.
        batch_size = None if str(batch_size).startswith("auto") else batch_size
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval's CLI passes --device, default cuda:0, whether or not there is a GPU
            if device:
                print(f"scse: device {device} is not available; using cpu", file=sys.stderr)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        with local_export(str(pretrained)) as local:  # a URL: a temporary local copy
            cfg = checkpoint_config(local)
            self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data, cfg.model)
            self.model, _ = load_model(local, device=device)
        fixed = getattr(self.model, "fixed_depth", None)
        self.depth = _int_arg("depth", depth) or fixed or cfg.model.depth
        if fixed is not None and self.depth != fixed:
            raise ValueError(f"depth={self.depth}: an untied model has a fixed depth of {fixed}")
        self.scorer = exit_scorer(str(exit), self.depth, exit_options)
        self.batch_size = _int_arg("batch_size", batch_size) or cfg.eval.batch_size
        self.max_length = _int_arg("max_length", max_length) or cfg.data.seq_len
        if self.max_length > cfg.model.max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds the model's "
                             f"max_seq_len={cfg.model.max_seq_len}")
        self.stride = _int_arg("stride", stride) or max(1, self.max_length // 2)
        if self.stride > self.max_length:
            raise ValueError(f"stride={self.stride} exceeds max_length={self.max_length}")
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.sha256

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        windows = [context_target_window(*context_target_ids(self.tokenizer, *request.args),
                                         self.eot_token_id, self.max_length)
                   for request in requests]
        scores = self._score(requests, windows, disable_tqdm)
        return [(-s.nll, s.all_correct) for s in scores]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False
                              ) -> list[float]:
        windows, owner = documents_windows([self.tokenizer.encode(r.args[0]) for r in requests],
                                           self.eot_token_id, self.max_length, self.stride)
        totals = [0.0] * len(requests)
        for i, score in zip(owner, self._score([requests[i] for i in owner], windows,
                                               disable_tqdm)):
            totals[i] -= score.nll
        return totals

    def _score(self, requests: list[Instance], windows: list[Window], quiet: bool = False
               ) -> list[Score]:
        """Each request's window(s) scored, task by task in request order (steps used counted per
        task), with progress per task on stderr on rank 0 unless lm-eval passes disable_tqdm."""
        tasks: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            tasks.setdefault(getattr(request, "task_name", None) or "", []).append(i)
        scores: list[Optional[Score]] = [None] * len(windows)
        for task, rows in tasks.items():
            label = f"scse {task or 'requests'} T={self.depth}"
            with Progress(len(rows), label, unit="window",
                          enabled=not quiet and self.rank == 0) as progress:
                task_scores = self.scorer.score(self.model, [windows[i] for i in rows],
                                                self.batch_size, task, progress)
            for i, score in zip(rows, task_scores):
                scores[i] = score
            if self.scorer.rule is not None:
                summary = self.scorer.stats[task].summary()
                print(f"scse: {task or 'requests'}: exit {summary['exit']}: mean steps "
                      f"{summary['mean_steps']:.3f} per scored token", file=sys.stderr)
        return cast("list[Score]", scores)  # every window is in one task's rows

    def get_model_info(self) -> dict:
        """What lm-eval adds to its results JSON's `config`: the depth, the exit rule and, with
        one, each task's steps used per scored token."""
        info: dict[str, Any] = {"scse_depth": self.depth,
                                "scse_exit": str(self.scorer.rule or "fixed")}
        if self.scorer.rule is not None:
            info["scse_steps"] = self.scorer.steps_summary()
        return info

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request alone, continuing EOS + context. Greedy unless do_sample (temperature,
        top_p); stops at EOS, max_gen_toks, or the first `until` string, which is cut off.
        Through the KV cache while the sequence fits max_length; beyond, a sliding window of
        max_length tokens recomputed per token (the cache cannot drop its oldest tokens)."""
        return [self._generate(*request.args) for request in requests]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        top_p = float(kwargs.pop("top_p", 1.0))
        sampling = Sampling(temperature, top_p) if do_sample and temperature > 0 else Sampling()
        generator = torch.Generator(device=self._device).manual_seed(int(kwargs.pop("seed", 0)))
        ids = [self.eot_token_id, *self.tokenizer.encode(context)]

        def stopped(new: list[int]) -> bool:
            return any(stop in self.tokenizer.decode(new) for stop in until)

        # the token after a sequence of n tokens sees them all while n <= max_length
        fits = min(max_new, self.max_length - len(ids) + 1)
        new: list[int] = []
        if fits > 0:
            new = generate(self.model, [ids], max_new_tokens=fits, depth=self.depth,
                           sampling=sampling, eos_id=self.eot_token_id,
                           exit_rule=self.scorer.rule, generator=generator,
                           stop=lambda row, tokens: stopped(tokens)).tokens[0]
        ended = bool(new) and (new[-1] == self.eot_token_id or stopped(new))
        if new and new[-1] == self.eot_token_id:
            new.pop()
        if not ended:
            new = self._slide(ids, new, max_new, sampling, generator, stopped)
        text = self.tokenizer.decode(new)
        for stop in until:
            text = text.split(stop, 1)[0]
        return text

    def _slide(self, ids: list[int], new: list[int], max_new: int, sampling: Sampling,
               generator: torch.Generator, stopped) -> list[int]:
        """Tokens past the window: each from the last max_length tokens, recomputed."""
        new = list(new)
        with torch.inference_mode():
            while len(new) < max_new:
                window = torch.tensor([(ids + new)[-self.max_length:]], device=self._device)
                logits = self.scorer.next_logits(self.model, window)
                token = int(next_tokens(logits, sampling, generator)[0])
                if token == self.eot_token_id:
                    break
                new.append(token)
                if stopped(new):
                    break
        return new
