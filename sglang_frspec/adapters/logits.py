"""Seam 2: the draft model's logits processor (installed on the draft instance only)."""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor

from sglang_frspec.adapters.head import HeadShard
from sglang_frspec.core import HotLogitsExchange, HotShardPlan


class FrSpecLogitsProcessor(LogitsProcessor):
    """Draft logits over a sharded hot head: float32 ``[rows, H]``, identical on every rank.

    Column j is global token ``plan.hot_ids[j]``. Each rank multiplies by its ``[width, hidden]``
    hot head, then one fixed-shape collective (a padded all-gather of the local logits, or a
    top-k packet) runs on every rank of the group that shards the target head, idle ranks
    included. Only ``_get_logits`` changes; pruning, DP-attention gather/scatter and the
    draft-extend graph buffer are SGLang's own.
    """

    def __init__(
        self,
        config,
        plan: HotShardPlan,
        shard: HeadShard,
        exchange: str,
        topk: int,
        device: torch.device | str,
    ):
        super().__init__(config)
        self.vocab_size = plan.num_hot  # what _copy_logits_to_buffer and the graph buffer expect
        self.plan = plan
        self.shard = shard
        # The top-k packet needs k < H; otherwise the full gather is exact and as cheap.
        self.exchange = exchange if 0 < topk < plan.num_hot else "full"
        self.topk = topk
        self.hot_logits = HotLogitsExchange(plan, shard.rank, device)

    def _local_logits(self, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.use_fp32_lm_head:
            local = hidden_states.float() @ weight.float().T
        else:
            local = hidden_states.to(weight.dtype) @ weight.T
        if self.logit_scale is not None:
            local.mul_(self.logit_scale)
        if self.final_logit_softcapping:
            # Elementwise, so applying it before the exchange equals stock's after-gather cap.
            cap = self.final_logit_softcapping
            local = cap * torch.tanh(local / cap)
        return local

    def _get_logits(
        self,
        hidden_states: torch.Tensor,
        lm_head,
        logits_metadata: LogitsMetadata,
        embedding_bias=None,
        use_logits_buffer: bool = True,
    ) -> torch.Tensor:
        hidden_states, local_hidden_states = self._gather_dp_attn_hidden_states(
            hidden_states, logits_metadata
        )
        local = self._local_logits(hidden_states, lm_head.weight)
        if self.exchange == "topk":
            logits = self.hot_logits.topk(local, self.topk, self.shard.all_gather)
        else:
            logits = self.hot_logits.full(local, self.shard.all_gather)
        logits = self._scatter_dp_attn_logits(logits, local_hidden_states, logits_metadata)
        logits = self._copy_logits_to_buffer(logits, logits_metadata, use_buffer=use_logits_buffer)
        return logits.contiguous()
