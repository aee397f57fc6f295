"""Seam 2: the draft model's logits processor (installed on the draft instance only)."""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor, fused_softcap

from sglang_frspec.adapters.contract import running_form
from sglang_frspec.adapters.head import HeadShard
from sglang_frspec.core import HotLogitsExchange, HotShardPlan, UnsupportedSetupError
from sglang_frspec.core.exchange_rule import exchange_at_start, exchange_for_step


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
        *,
        logit_scale: float | None = None,
        needs_distribution: bool = False,
    ):
        super().__init__(config, logit_scale=logit_scale)
        self.vocab_size = plan.num_hot  # what _copy_logits_to_buffer and the graph buffer expect
        self.plan = plan
        self.shard = shard
        self.exchange = exchange_at_start(exchange, plan, topk, needs_distribution=needs_distribution)
        self.topk = topk
        self.hot_logits = HotLogitsExchange(plan, shard.rank, device)
        # Releases whose copy takes no softcap cap after it in float32, as this does unfused.
        self.softcap_fuses_with_copy = running_form("softcap") == "fused_with_copy"

    def exchange_for_rows(self, local: torch.Tensor) -> str:
        """The exchange for this step's ``[rows, width]`` local logits (the same on every rank)."""
        return exchange_for_step(self.exchange, self.plan, local.shape[0], self.topk, local.element_size(),
                                 local.device.type)  # fmt: skip

    def _check_head(self, lm_head) -> None:
        """Python-level guard (graph-safe): the head the draft passes must be the hot head."""
        weight = getattr(lm_head, "weight", None)
        if weight is None or tuple(weight.shape[:1]) != (self.plan.width,):
            raise UnsupportedSetupError(
                f"sglang-frspec: the draft passed an LM head of shape "
                f"{None if weight is None else tuple(weight.shape)} to the hot-logits processor, "
                f"not this rank's hot head ({self.plan.width} rows); the draft does not use "
                "the head set by set_embed_and_head(). Serve it without --speculative-token-map."
            )

    def _local_logits(self, hidden_states: torch.Tensor, lm_head) -> torch.Tensor:
        """``[rows, width]`` logits of this rank's hot head, computed as stock computes a shard.

        SGLang's own GEMM: on CUDA an fp32 head (``enable_fp32_lm_head``) or fp32 output
        (``enable_lm_head_output_fp32``) is an fp32-output matmul that never copies the weight.
        """
        local = self._compute_lm_head(hidden_states, lm_head)
        if self.logit_scale is not None:
            local.mul_(self.logit_scale)
        return local

    def _softcap_float32(self, logits: torch.Tensor) -> torch.Tensor:
        """Stock's softcap, in float32 (``logits`` is float32)."""
        cap = self.final_logit_softcapping
        if logits.is_cuda:
            fused_softcap(logits, cap)
            return logits
        return cap * torch.tanh(logits / cap)

    def _get_logits(
        self,
        hidden_states: torch.Tensor,
        lm_head,
        logits_metadata: LogitsMetadata,
        embedding_bias=None,
        use_logits_buffer: bool = True,
    ) -> torch.Tensor:
        self._check_head(lm_head)
        hidden_states, local_hidden_states = self._gather_dp_attn_hidden_states(
            hidden_states, logits_metadata
        )
        local = self._local_logits(hidden_states, lm_head)
        cap = self.final_logit_softcapping
        if self.exchange_for_rows(local) == "topk":
            # The packet's values and rest mass must be those of the capped float32 logits,
            # so cap before it (elementwise: the same values stock caps after its gather).
            logits = self.hot_logits.topk(
                self._softcap_float32(local.float()) if cap else local, self.topk, self.shard.all_gather
            )
            cap = None
        else:
            logits = self.hot_logits.full(local, self.shard.all_gather)
        logits = self._scatter_dp_attn_logits(logits, local_hidden_states, logits_metadata)
        # As stock: cast to float32 (into the graph buffer when it fits), then cap in float32.
        fuse_cast_softcap = (
            bool(cap)
            and self.softcap_fuses_with_copy
            and logits.is_cuda
            and logits.dtype in (torch.float16, torch.bfloat16)
        )
        if fuse_cast_softcap:
            logits = self._copy_logits_to_buffer(
                logits, logits_metadata, use_buffer=use_logits_buffer, softcap=cap
            )
        else:
            logits = self._copy_logits_to_buffer(logits, logits_metadata, use_buffer=use_logits_buffer)
        if cap and not fuse_cast_softcap:
            logits = self._softcap_float32(logits)
        return logits.contiguous()
