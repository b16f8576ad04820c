"""A KV cache for looped LMs: one slot per physical block x loop step.

The core's blocks at step t attend over the previous tokens' step-t keys and values, so a cache
holds one slot per prelude block, (core block, step) and coda block; scse adds one per core block
for r* = Phi(h*). Each new token costs one token at depth T, never a re-run of the prefix.

Modes:
  exact   (default) one slot per (core block, step): token-identical to recomputing the whole
          sequence without a cache.
  shared  one slot per physical core block, overwritten at each step (Huginn's compress-s with
          s = 1): memory constant in T; the likelihood moves.

Use: LoopedLM.decode_step, once with the prompt, then once per generated token.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

CacheMode = Literal["exact", "shared"]
CACHE_MODES = ("exact", "shared")


class KVSlot:
    """The cached keys and values of one attention call site, (B, H_kv, L, head_dim) each (H_kv:
    model.n_kv_heads, fewer than the query heads under grouped-query attention), in buffers with
    spare room (doubled when full). `update` writes the new K/V after the cached ones and returns
    views up to them; a second update in the same call overwrites the same place; `commit` keeps
    it."""

    def __init__(self) -> None:
        self.k_buf: Optional[torch.Tensor] = None
        self.v_buf: Optional[torch.Tensor] = None
        self.length = 0  # committed tokens
        self.pending = 0  # tokens written by this call's updates, not yet committed

    @property
    def k(self) -> Optional[torch.Tensor]:
        return None if self.k_buf is None else self.k_buf[:, :, :self.length]

    @property
    def v(self) -> Optional[torch.Tensor]:
        return None if self.v_buf is None else self.v_buf[:, :, :self.length]

    def _reserve(self, k: torch.Tensor, end: int) -> None:
        if self.k_buf is not None and self.k_buf.shape[2] >= end:
            return
        b, h, _, d = k.shape
        room = max(end, 2 * (0 if self.k_buf is None else self.k_buf.shape[2]), 16)
        k_buf, v_buf = k.new_empty(b, h, room, d), k.new_empty(b, h, room, d)
        if self.k_buf is not None:
            assert self.k is not None and self.v is not None  # the buffers are set together
            k_buf[:, :, :self.length] = self.k
            v_buf[:, :, :self.length] = self.v
        self.k_buf, self.v_buf = k_buf, v_buf

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self._reserve(k, end)
        assert self.k_buf is not None and self.v_buf is not None  # _reserve made them
        self.k_buf[:, :, self.length:end] = k
        self.v_buf[:, :, self.length:end] = v
        self.pending = k.shape[2]
        return self.k_buf[:, :, :end], self.v_buf[:, :, :end]

    def commit(self) -> None:
        self.length += self.pending
        self.pending = 0


class KVCache:
    """The K/V of every attention call site, the key padding mask and each row's position.

    Slots are made on first use; keys name the call site: ("prelude", i), ("coda", i),
    ("core", block, step) (exact) or ("core", block) (shared), ("response", j) (scse's r*).
    """

    def __init__(self, mode: CacheMode = "exact") -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode: must be one of {', '.join(CACHE_MODES)}; got {mode!r}")
        self.mode = mode
        self.slots: dict[tuple, KVSlot] = {}
        self.key_mask: Optional[torch.Tensor] = None  # (B, L) bool: real token, not padding
        self.next_position: Optional[torch.Tensor] = None  # (B,) real tokens seen per row
        self.depth: Optional[int] = None  # the loop steps cached; fixed by the first call

    def __len__(self) -> int:
        """L: the cached sequence length (padding included)."""
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def slot(self, *key) -> KVSlot:
        return self.slots.setdefault(key, KVSlot())

    def core_slot(self, block: int, step: int) -> KVSlot:
        """The slot of physical core block `block` at loop step `step`."""
        return self.slot("core", block) if self.mode == "shared" else self.slot("core", block, step)

    def tensors(self) -> list[torch.Tensor]:
        """The cached keys and values, one (B, H_kv, L, head_dim) view each."""
        return [t for s in self.slots.values() for t in (s.k, s.v) if t is not None]

    def nbytes(self) -> int:
        """Bytes of cached keys and values (the buffers' spare room not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def positions(self, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE position ids (B, S), counted from each row's first real token, and the attention
        mask (B, 1, S, L + S) of new tokens given their attention_mask (B, S): 1 real, 0 padding.
        """
        b, s = attention_mask.shape
        new = attention_mask.bool()
        if self.key_mask is not None and self.key_mask.shape[0] != b:
            raise ValueError(f"cache: holds a batch of {self.key_mask.shape[0]} rows, got {b}")
        start = self.next_position if self.next_position is not None else \
            torch.zeros(b, dtype=torch.long, device=new.device)
        position_ids = (start[:, None] + new.long().cumsum(-1) - 1).clamp(min=0)
        if s == 1:  # one token (each generated one): causal_mask's value in 2 ops, not 7
            seen = torch.ones_like(new)  # it sees every real cached token and itself
            keys = seen if self.key_mask is None else torch.cat([self.key_mask, seen], dim=1)
            return position_ids, keys[:, None, None, :]
        keys = new if self.key_mask is None else torch.cat([self.key_mask, new], dim=1)
        return position_ids, causal_mask(keys, s)

    def trailing_mask(self, s: int) -> torch.Tensor:
        """(B, 1, s, L) attention mask of the last s cached tokens as queries (verify)."""
        assert self.key_mask is not None  # tokens are cached
        return causal_mask(self.key_mask, s)

    def commit_slots(self) -> None:
        """Append every slot's new K/V, leaving the padding mask and positions as they are."""
        for s in self.slots.values():
            s.commit()

    def commit(self, attention_mask: torch.Tensor) -> None:
        """End of a call: append every slot's new K/V and the new tokens' padding mask."""
        self.commit_slots()
        new = attention_mask.bool()
        self.key_mask = new if self.key_mask is None else torch.cat([self.key_mask, new], dim=1)
        added = new.long().sum(-1)
        self.next_position = added if self.next_position is None else self.next_position + added

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (rejected speculative drafts): the K/V
        stay in the buffers and are overwritten by the next update."""
        for s in self.slots.values():
            s.length, s.pending = min(s.length, length), 0
        if self.key_mask is not None and length < self.key_mask.shape[1]:
            assert self.next_position is not None  # set with key_mask
            self.next_position = self.next_position - self.key_mask[:, length:].long().sum(-1)
            self.key_mask = self.key_mask[:, :length]


def causal_mask(keys: torch.Tensor, s: int) -> torch.Tensor:
    """(B, 1, s, L) bool for the last s of L keys (B, L) as queries: causal, padding keys masked,
    and each query sees itself (so a padding row's softmax is never empty, no NaN)."""
    past = keys.shape[1] - s
    q = torch.arange(s, device=keys.device)[:, None] + past
    k = torch.arange(keys.shape[1], device=keys.device)[None, :]
    return ((k <= q) & keys[:, None, None, :]) | (k == q)


class _StepHook:
    """One core block's hook at one step: rows that have exited reuse their latest K/V; then the
    slot (if any) appends them to the cached ones."""

    def __init__(self, view: LoopKV, j: int, slot: Optional[KVSlot], response: bool) -> None:
        self.view, self.j, self.slot, self.response = view, j, slot, response

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = self.view
        if not self.response:
            if view.active is not None and self.j in view.latest:
                keep = view.active[:, None, :, None]  # (B, S) -> over heads and head_dim
                k_last, v_last = view.latest[self.j]
                k, v = torch.where(keep, k, k_last), torch.where(keep, v, v_last)
            view.latest[self.j] = (k, v)
        return (k, v) if self.slot is None else self.slot.update(k, v)


class LoopKV:
    """The core's view of the K/V during one loop run (LoopCore.adaptive): each step's hooks.
    `active` (B, S): tokens still iterating; an exited token's latest K/V stand in for the steps
    it skips (and, via `finish`, fill their cache slots). cache None: nothing is kept."""

    def __init__(self, cache: Optional[KVCache], core) -> None:
        self.cache, self.core = cache, core
        self.active: Optional[torch.Tensor] = None
        self.latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block in group -> K/V

    def hooks(self, t: int, response: bool = False) -> list[_StepHook]:
        """One hook per core block of step t's group, or of scse's r* call (`response`)."""
        n, cache = self.core.n_core, self.cache  # (a KVCache with no tokens yet is falsy)
        if response:
            return [_StepHook(self, j, None if cache is None else cache.slot("response", j), True)
                    for j in range(n)]
        base = self.core.transition.group(t) * n
        return [_StepHook(self, j, None if cache is None else cache.core_slot(base + j, t), False)
                for j in range(n)]

    def finish(self, steps_run: int) -> None:
        """Fill the cache slots of steps steps_run..depth-1 with each block's latest K/V."""
        if self.cache is None:
            return
        assert self.cache.depth is not None  # fixed by the cache's first call
        for t in range(steps_run, self.cache.depth):
            for hook in self.hooks(t):
                assert hook.slot is not None  # with a cache, every hook has its slot
                if not hook.slot.pending:
                    hook.slot.update(*self.latest[hook.j])
