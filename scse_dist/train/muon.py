"""train.optimizer.kind: muon — Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/)
for the 2-D matrices of prelude, loop core and coda (muon_scope loop: the core's alone, SCSE's
anchor and the concat adapter included), AdamW for the embedding, head, gains and the rest.

DeepSpeed's MuonWithAuxAdam, handed to deepspeed.initialize as a client optimizer: ZeRO-1/2
orthogonalise each matrix's whole gradient while they partition (a flat partition holds pieces
of matrices) and keep its momentum partitioned.

Clipping: at ZeRO-1/2 the partition DeepSpeed clips already holds Muon's orthogonalised update
(norm ~ sqrt(width) per matrix), which its gradient_clipping would shrink, unlike ZeRO-0's. So
DeepSpeed's clipping is off under muon and this optimizer clips each AdamW group's gradient to
train.optimizer.grad_clip itself; Muon's update has a fixed norm by construction.

Imports DeepSpeed: import it only where an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

from scse_dist.param_groups import with_lr_mult

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

ADAMW_EPS = 1e-8  # torch.optim.AdamW's default, so the AdamW half equals torch_adamw's


# train.optimizer.muon_scope -> the parts whose 2-D parameters Muon steps (by module, so parts
# holding bare parameters count too; loop is group_of's anchor, adapter, core_attn, core_mlp)
MUON_PARTS = {"all": ("prelude", "core", "coda"), "loop": ("core",)}


def muon_split(model: LoopedLM, scope: str = "all"
               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(muon, adamw): the trainable 2-D parameters of prelude, core and coda (scope all) or of
    the core alone (loop); everything else."""
    in_blocks = {id(p) for part in MUON_PARTS[scope]
                 for p in getattr(model, part).parameters() if p.dim() == 2}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ([p for p in trainable if id(p) in in_blocks],
            [p for p in trainable if id(p) not in in_blocks])


def _eager_kernels() -> None:
    """Run DeepSpeed's Muon kernels eagerly: they are torch.compile'd at import, and on CPU the
    compile takes far longer than the eager Newton–Schulz it would speed up."""
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    for name in ("muon_update", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
        fn = getattr(original_muon, name)
        setattr(original_muon, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    muon_optimizer.muon_update = original_muon.muon_update


def build_muon(model: LoopedLM, opt: Any, on_cuda: bool) -> torch.optim.Optimizer:
    """MuonWithAuxAdam over muon_split(model), with train.optimizer's muon_* and AdamW settings."""
    if not on_cuda:
        _eager_kernels()
    muon, adamw = muon_split(model, opt.muon_scope)
    # the embedding/head (and, scope loop, the prelude's and coda's matrices); gains keep scale
    decay = [p for p in adamw if p.dim() >= 2]
    rest = [p for p in adamw if p.dim() < 2]
    # AdamW's decay group first: the training log's `lr` is group 0's, lr as with AdamW
    groups = [dict(params=params, use_muon=False, lr=opt.lr, weight_decay=wd,
                   betas=(opt.beta1, opt.beta2), eps=ADAMW_EPS)
              for params, wd in ((decay, opt.weight_decay), (rest, 0.0)) if params]
    # lr_mult scales the AdamW half only (Muon's matrices keep muon_lr)
    groups = with_lr_mult(model.named_parameters(), groups, opt.lr, opt.lr_mult,
                          "train.optimizer.kind: muon's AdamW half")
    groups.append(dict(params=muon, use_muon=True, lr=opt.muon_lr, momentum=opt.muon_momentum,
                       weight_decay=opt.muon_weight_decay, ns_method="standard"))
    adam: Any = torch.optim.AdamW
    if opt.update_clip:  # StableAdamW's clipping on the AdamW half too
        from functools import partial

        from scse_dist.train.update_clip import UpdateClippedAdamW

        adam = partial(UpdateClippedAdamW, update_clip=opt.update_clip)
    muon_ids = {id(p) for p in muon}
    for p in model.parameters():  # what ZeRO-1/2 read to find the matrices to orthogonalise
        p.use_muon = id(p) in muon_ids
    return MuonAdamW(groups, clip=opt.grad_clip, adam_optimizer=adam,
                     adam_optimizer_kwargs={"fused": True} if on_cuda else {})


class MuonAdamW(MuonWithAuxAdam):
    """DeepSpeed's MuonWithAuxAdam that first clips each AdamW group's gradient to `clip`."""

    def __init__(self, param_groups: list[dict], clip: float, **kwargs: Any) -> None:
        super().__init__(param_groups, **kwargs)
        self.clip = clip
        # True once DeepSpeed wraps this optimizer (ZeRO-1/2, bf16): each rank then steps only
        # its slice of every group, so a group's squared norm is summed over the ranks.
        self.partitioned = False

    @torch.no_grad()
    def step(self, closure: Any = None, step_id: Any = None) -> Any:
        if self.clip > 0:
            for group in self.param_groups:  # ZeRO-1/2 step one group per call, on every rank
                if not group["use_muon"]:
                    self._clip_group(group)
        return super().step(closure, step_id)

    def _clip_group(self, group: dict) -> None:
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if not grads:
            return
        square = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        if self.partitioned and dist.is_initialized():
            dist.all_reduce(square)
        scale = (self.clip / (square.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
