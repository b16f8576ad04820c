"""Document masking (model.document_mask): attention within the documents of a packed row.

Boundaries come from the eos tokens of a packed row (`document_ids`). An eos opens the document
after it, as the held-out scorer's windows [eos, *document] do, so a document's first token is
predicted from eos alone; the row's leading tokens are a document of their own. Positions are not
restarted per document: RoPE logits depend on the query-key offset only.

Backends, chosen at run time by the device of the tokens (the choice printed once):
  sdpa  a (B, 1, S, S) bool block-diagonal causal mask: CPU, and CUDA without FlexAttention.
  flex  FlexAttention's BlockMask and a compiled flex_attention, on CUDA: skips masked tiles.
$SCSE_DOCMASK_BACKEND=sdpa|flex forces one (flex on CPU runs unfused, slow).

`attend` also serves grouped-query attention (model.n_kv_heads): keys and values with fewer heads
than the queries, each shared by a group of query heads.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

BACKEND_ENV = "SCSE_DOCMASK_BACKEND"
BACKENDS = ("sdpa", "flex")

try:  # torch >= 2.5 (pyproject allows 2.4)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch: the SDPA mask everywhere
    create_block_mask = flex_attention = None  # type: ignore[assignment]

# SDPA's enable_gqa: torch >= 2.5
_SDPA_GQA = torch.__version__ >= "2.5"
_logged: set[str] = set()
_compiled_flex: Optional[Callable[..., Any]] = None


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) long: the index of each position's document in its row (0 for the row's leading
    tokens, +1 at every eos, which opens the next document)."""
    return (tokens == eos_id).long().cumsum(-1)


class FlexMask:
    """A FlexAttention BlockMask and the attention call that reads it (`attend` dispatches)."""

    def __init__(self, block_mask: Any, compiled: bool) -> None:
        self.block_mask, self.compiled = block_mask, compiled

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        global _compiled_flex
        fn: Any = flex_attention
        # inside train.engine.compile's compiled block dynamo compiles flex_attention itself;
        # outside, a compiled one is made once per process (unfused flex materializes (B, H, S, S))
        if self.compiled and not torch.compiler.is_compiling():
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention, dynamic=False)
            fn = _compiled_flex
        # compiled flex misreads strided views (v straight from the qkv split)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if k.shape[1] != q.shape[1]:  # grouped-query: flex shares each k/v head itself
            return fn(q, k, v, block_mask=self.block_mask, enable_gqa=True)
        return fn(q, k, v, block_mask=self.block_mask)


# What blocks take as `mask`: None (plain causal), a bool/additive SDPA mask, or a FlexMask.
AttnMask = Union[torch.Tensor, FlexMask]


def backend_for(device: torch.device) -> str:
    """flex on CUDA where FlexAttention exists, else sdpa; $SCSE_DOCMASK_BACKEND overrides."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}: expected one of {', '.join(BACKENDS)}, got "
                             f"{forced!r}")
        if forced == "flex" and flex_attention is None:
            raise ValueError(f"{BACKEND_ENV}=flex: this torch ({torch.__version__}) has no "
                             "FlexAttention")
        return forced
    return "flex" if device.type == "cuda" and flex_attention is not None else "sdpa"


def sdpa_document_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> (B, 1, S, S) bool: causal and inside the query's document."""
    s = doc.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_mask(doc: torch.Tensor) -> AttnMask:
    """The attention mask of document ids `doc` (B, S) for the backend chosen for its device."""
    backend = backend_for(doc.device)
    if backend not in _logged:
        _logged.add(backend)
        print(f"model.document_mask: attention within documents through {backend} "
              f"({doc.device.type})", file=sys.stderr, flush=True)
    if backend == "sdpa":
        return sdpa_document_mask(doc)
    assert create_block_mask is not None  # backend_for returns flex only where it exists

    def within_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    b, s = doc.shape
    block_mask = create_block_mask(within_document, b, None, s, s, device=doc.device)
    return FlexMask(block_mask, compiled=doc.device.type == "cuda")


def fused_gqa(q: torch.Tensor, mask: Optional[AttnMask]) -> bool:
    """Whether SDPA's enable_gqa has a fused kernel for these queries: CPU's, and CUDA's flash
    attention (fp16/bf16, head_dim <= 256, no mask). Elsewhere it falls back to the math kernel,
    which materializes the scores: repeating k/v heads keeps the memory-efficient one."""
    if mask is not None or not _SDPA_GQA:
        return False
    return q.device.type == "cpu" or (q.dtype in (torch.float16, torch.bfloat16)
                                      and q.shape[-1] <= 256)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: Optional[AttnMask]) -> torch.Tensor:
    """Attention of (B, H, S, head_dim) q and (B, H_kv, L, head_dim) k, v under `mask` (None:
    plain causal). H_kv divides H; query head i reads k/v head i // (H / H_kv) (grouped-query)."""
    if isinstance(mask, FlexMask):
        return mask.attend(q, k, v)
    if k.shape[1] != q.shape[1]:
        if fused_gqa(q, mask):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
