"""The language model: embedding -> prelude -> LoopCore -> coda -> final norm -> (tied) head."""

from __future__ import annotations

import os
from typing import Iterable, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import Block, RMSNorm, RopeTables, attention_mask_4d, rope_tables
from .config import ModelConfig
from .documents import AttnMask, document_ids, document_mask
from .exit_rules import ExitRule
from .kv_cache import KVCache, LoopKV
from .loss import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    chunked_cross_entropy_with_z_loss,
    z_loss_of_logits,
)
from .recurrence import LoopCore
from .transitions import check_model_config


class LMOutput(NamedTuple):
    """A NamedTuple, not a dataclass: ZeRO-3 hooks the backward of tensors in tuples only."""

    logits: Optional[torch.Tensor]  # (B, S, V) at the final depth; None if keep_logits=False
    loss: Optional[torch.Tensor]  # mean cross-entropy at the final depth, if targets given
    logits_by_depth: Optional[dict[int, torch.Tensor]]
    loss_by_depth: Optional[dict[int, torch.Tensor]]
    core_calls: int  # Phi applications the output depends on (scse: T+1, others: T)
    depth: int  # the final depth run (with an exit rule: the most steps a token may take)
    steps_used: Optional[torch.Tensor] = None  # (B, S) long: loop steps per token (exit_rule)
    # cfg.loop_stability's weighted term (training); the trainer adds it to `loss` before backward
    aux_loss: Optional[torch.Tensor] = None
    # forward(z_loss=w > 0): w * mean(logsumexp(logits)^2), and loss + z_loss, what training
    # backpropagates
    z_loss: Optional[torch.Tensor] = None
    objective: Optional[torch.Tensor] = None


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # (B, S, V) for the new tokens
    steps: torch.Tensor  # (B, S) long: loop steps each new token ran (its depth, or its exit)


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # checked before any block computes constants from the fields
        transition = check_model_config(cfg)
        self.cfg = cfg
        ckpt_blocks = cfg.activation_checkpointing == "block"
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg, ckpt_blocks, transition)
                                     for _ in range(cfg.n_prelude))
        self.core = LoopCore(cfg, transition)
        self.coda = nn.ModuleList(Block(cfg, ckpt_blocks, transition) for _ in range(cfg.n_coda))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head: Optional[nn.Linear] = None
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            nn.init.normal_(self.head.weight, std=cfg.init_std)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)

    @property
    def fixed_depth(self) -> Optional[int]:
        """None for the looped kinds (any depth runs); the only allowed depth for untied."""
        return self.core.fixed_depth

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def rope(self, tokens: torch.Tensor) -> RopeTables:
        """RoPE's cos/sin for this sequence length: made once per forward, used by every block."""
        return rope_tables(tokens.shape[-1], self.cfg, tokens.device)

    def documents(self, tokens: torch.Tensor, eos_id: int) -> Optional[torch.Tensor]:
        """forward's `document_ids` for packed `tokens` (None with model.document_mask off)."""
        return document_ids(tokens, eos_id) if self.cfg.document_mask else None

    def positions(self, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None,
                  document_ids: Optional[torch.Tensor] = None
                  ) -> tuple[RopeTables, Optional[AttnMask]]:
        """RoPE tables and the attention mask of one forward (see forward's docstring)."""
        if document_ids is not None:
            if attention_mask is not None:
                raise ValueError("document_ids: not with attention_mask (a padded batch holds one "
                                 "document per row)")
            if document_ids.shape != tokens.shape:
                raise ValueError(f"document_ids: expected the tokens' shape "
                                 f"{tuple(tokens.shape)}, got {tuple(document_ids.shape)}")
            rope = rope_tables(tokens.shape[-1], self.cfg, tokens.device, position_ids)
            return rope, document_mask(document_ids.to(tokens.device))
        if attention_mask is None and position_ids is None:
            return self.rope(tokens), None  # the training path: positions 0..S-1, is_causal
        if position_ids is None:  # left padding: a sequence's first real token is position 0
            assert attention_mask is not None  # not both None: returned above
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        rope = rope_tables(tokens.shape[-1], self.cfg, tokens.device, position_ids)
        return rope, None if attention_mask is None else attention_mask_4d(attention_mask)

    def source(self, tokens: torch.Tensor, rope: Optional[RopeTables] = None,
               mask: Optional[AttnMask] = None) -> torch.Tensor:
        """s = P(E[tokens]) (or the embedding when n_prelude = 0)."""
        h = self.embed(tokens)
        for block in self.prelude:
            h = block(h, rope, mask)
        return h

    def head_input(self, h: torch.Tensor, rope: Optional[RopeTables] = None,
                   mask: Optional[AttnMask] = None) -> torch.Tensor:
        """What the LM head reads from a loop state: coda, then the final norm."""
        for block in self.coda:
            h = block(h, rope, mask)
        return self.norm(h)

    @property
    def head_weight(self) -> torch.Tensor:
        """(V, d): the embedding matrix when tied. Read at use: ZeRO-3 gathers it on access."""
        return self.head.weight if self.head is not None else self.embed.weight

    def readout(self, h: torch.Tensor, rope: Optional[RopeTables] = None,
                mask: Optional[AttnMask] = None) -> torch.Tensor:
        """Logits from a loop state: coda, final norm, head."""
        return F.linear(self.head_input(h, rope, mask), self.head_weight)

    def compile_blocks(self) -> None:
        """torch.compile every block's math (Block.compile_math); backend inductor, or
        $SCSE_COMPILE_BACKEND (tests use aot_eager)."""
        backend = os.environ.get("SCSE_COMPILE_BACKEND", "inductor")
        for module in self.modules():
            if isinstance(module, Block):
                module.compile_math(backend)

    def _resolve_depths(self, depth: Optional[int], readout_depths: Optional[Iterable[int]]
                        ) -> tuple[int, Optional[list[int]]]:
        readouts = None if readout_depths is None else sorted({int(t) for t in readout_depths})
        if readouts is not None and not readouts:
            raise ValueError("readout_depths: expected at least one depth, got an empty iterable")
        if depth is not None:
            final = max([depth] + (readouts or []))
        else:
            final = readouts[-1] if readouts else (self.fixed_depth or self.cfg.depth)
        asked = [final] + (readouts or [])
        if min(asked) < 1:
            raise ValueError(f"depth: loop depths must be >= 1, got depth={depth}, "
                             f"readout_depths={readouts}")
        fixed = self.fixed_depth
        if fixed is not None and any(t != fixed for t in asked):
            raise ValueError(f"depth: recurrence={self.cfg.recurrence} (untied_match="
                             f"{self.cfg.untied_match}) has the fixed depth {fixed}; got "
                             f"depth={depth}, readout_depths={readouts}")
        return final, readouts

    def iter_depth_logits(self, tokens: torch.Tensor, depths: Iterable[int],
                          document_ids: Optional[torch.Tensor] = None
                          ) -> Iterator[tuple[int, torch.Tensor]]:
        """One loop run to max(depths), then (depth, logits) per depth in increasing order, made
        lazily so a caller holds one (B, S, V) tensor at a time."""
        for t, h in self.iter_depth_head_inputs(tokens, depths, document_ids):
            yield t, F.linear(h, self.head_weight)

    def iter_depth_head_inputs(self, tokens: torch.Tensor, depths: Iterable[int],
                               document_ids: Optional[torch.Tensor] = None
                               ) -> Iterator[tuple[int, torch.Tensor]]:
        """As iter_depth_logits, but (depth, the LM head's input (B, S, d)), for a caller that
        applies `head_weight` to a few rows only (scse_dist.eval.scoring)."""
        final, readouts = self._resolve_depths(None, depths)
        assert readouts is not None
        rope, mask = self.positions(tokens, document_ids=document_ids)
        states = self.core(self.source(tokens, rope, mask), final, readout_depths=readouts,
                           rope=rope, mask=mask)
        for t, state in zip(readouts, states):
            yield t, self.head_input(state, rope, mask)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                depth: Optional[int] = None, readout_depths: Optional[Iterable[int]] = None,
                backprop_steps: int = 0, keep_logits: bool = True,
                initial_state: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None,
                exit_rule: Optional[ExitRule] = None, z_loss: float = 0.0) -> LMOutput:
        """Run the loop once to the final depth and read out the requested depths.

        tokens, targets: (B, S) long; targets equal to IGNORE_INDEX (-100) are left out.
        keep_logits=False (training, perplexity): the loss is computed in row chunks and no
        (B, S, V) logits are formed (scse_dist.model.loss).
        depth: None -> max(readout_depths), else cfg.depth (untied: its fixed_depth). With both,
        the loop runs to the larger and the final depth is read out too.
        readout_depths: coda+head applied at each of these depths of the same loop run.
        backprop_steps=k > 0: gradients flow through only the last k loop steps.
        initial_state: (B, S, d) replaces H0.
        attention_mask: (B, S) 1 for real tokens, 0 for (left) padding, whose keys every block
        masks. position_ids: (B, S) RoPE positions; with a mask and none, each row counts from its
        first real token. Both None (training): plain causal attention at positions 0..S-1.
        document_ids: (B, S) ids of the packed documents (`documents`; not with attention_mask):
        each token attends only within its document (documents.py).
        exit_rule: adaptive depth per token (eval, no grad; LoopCore.adaptive) up to the rule's
        max_steps (else the depth above); steps_used says how many steps each token took. Not
        with readout_depths, backprop_steps or initial_state.
        z_loss: weight of PaLM's z-loss at the final depth (training; needs targets): the output's
        z_loss and objective (LMOutput). `loss` stays the cross-entropy.
        """
        if exit_rule is not None:
            if readout_depths is not None or backprop_steps or initial_state is not None:
                raise ValueError("exit_rule: adaptive depth reads out one state per token; it "
                                 "takes no readout_depths, backprop_steps or initial_state")
            depth = exit_rule.max_steps or depth
        final, readouts = self._resolve_depths(depth, readout_depths)
        wanted = sorted(set(readouts or []) | {final})
        rope, mask = self.positions(tokens, attention_mask, position_ids, document_ids)
        log_probs = None
        if exit_rule is not None and exit_rule.needs_readout:
            def log_probs(h: torch.Tensor) -> torch.Tensor:
                return F.log_softmax(self.readout(h, rope, mask).float(), dim=-1)
        stability = self.cfg.loop_stability > 0 and exit_rule is None and targets is not None \
            and torch.is_grad_enabled()
        outs = self.core(self.source(tokens, rope, mask), final, readout_depths=wanted,
                         backprop_steps=backprop_steps, initial_state=initial_state,
                         rope=rope, mask=mask, exit_rule=exit_rule,
                         log_probs=log_probs, stability=stability)
        steps_used = outs[1] if exit_rule is not None else None
        states = dict(zip(wanted, outs))
        aux_loss = outs[-1] if stability else None
        if z_loss and targets is None:
            raise ValueError("z_loss: a term of the training loss; it needs targets")
        logits_by_depth: dict[int, torch.Tensor] = {}
        loss_by_depth: dict[int, torch.Tensor] = {}
        z_term = objective = None
        for t in wanted:
            if not keep_logits:
                if targets is None:
                    continue
                h = self.head_input(states[t], rope, mask)
                if z_loss and t == final:
                    objective, loss_by_depth[t], z_term = chunked_cross_entropy_with_z_loss(
                        h, self.head_weight, targets, z_loss)
                else:
                    loss_by_depth[t] = chunked_cross_entropy(h, self.head_weight, targets)
                continue
            logits_by_depth[t] = logits = self.readout(states[t], rope, mask)
            if targets is not None:
                loss_by_depth[t] = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                   ignore_index=IGNORE_INDEX)
                if z_loss and t == final:
                    z_term = z_loss * z_loss_of_logits(logits, targets)
                    objective = loss_by_depth[t] + z_term
        return LMOutput(
            logits=logits_by_depth.get(final),
            loss=loss_by_depth.get(final),
            logits_by_depth=logits_by_depth if readouts is not None and keep_logits else None,
            loss_by_depth=loss_by_depth if readouts is not None and targets is not None else None,
            core_calls=self.core.core_calls(final),
            depth=final,
            steps_used=steps_used,
            aux_loss=aux_loss,
            z_loss=z_term,
            objective=objective,
        )

    @torch.no_grad()
    def cached_prelude(self, tokens: torch.Tensor, cache: KVCache, depth: int,
                       attention_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, RopeTables, torch.Tensor]:
        """New tokens through the embedding and the prelude over the KV cache, which is bound to
        one `depth`: (h, rope, mask) for the loop (decode_step, speculative drafting)."""
        if cache.depth is None:
            cache.depth = depth
        elif cache.depth != depth:
            raise ValueError(f"depth: this cache holds {cache.depth} loop steps, got depth={depth}")
        position_ids, mask = cache.positions(attention_mask.to(tokens.device))
        rope = rope_tables(tokens.shape[-1], self.cfg, tokens.device, position_ids)
        h = self.embed(tokens)
        for i, block in enumerate(self.prelude):
            h = block(h, rope, mask, cache.slot("prelude", i))
        return h, rope, mask

    def cached_head_input(self, h: torch.Tensor, rope: RopeTables, mask: torch.Tensor,
                          cache: KVCache, slots: str = "coda") -> torch.Tensor:
        """head_input over the KV cache: the coda with the cache's `slots`, then the final norm."""
        for i, block in enumerate(self.coda):
            h = block(h, rope, mask, cache.slot(slots, i))
        return self.norm(h)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, *, depth: Optional[int] = None,
                    attention_mask: Optional[torch.Tensor] = None,
                    exit_rule: Optional[ExitRule] = None) -> DecodeOutput:
        """Logits of new tokens given the ones in `cache`, whose K/V it then appends
        (scse_dist.model.kv_cache). The prefill is the same call with the whole prompt.

        tokens (B, S); attention_mask (B, S): 1 real, 0 padding (None: all real). depth: loop
        steps (default cfg.depth), the same for every call on one cache. exit_rule: per-token
        early exit, as in forward; an exited token's latest K/V fill the slots of skipped steps.
        """
        if exit_rule is not None:
            depth = exit_rule.max_steps or depth
        depth, _ = self._resolve_depths(depth, None)
        attention_mask = torch.ones_like(tokens) if attention_mask is None else attention_mask
        h, rope, mask = self.cached_prelude(tokens, cache, depth, attention_mask)

        def coda_head(h: torch.Tensor) -> torch.Tensor:
            return F.linear(self.cached_head_input(h, rope, mask, cache), self.head_weight)

        h, steps = self.core.adaptive(h, depth, exit_rule, rope, mask,
                                      lambda h: coda_head(h).float().log_softmax(-1),
                                      LoopKV(cache, self.core))
        logits = coda_head(h)
        cache.commit(attention_mask)
        return DecodeOutput(logits, steps)
