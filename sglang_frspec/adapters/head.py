"""Seam 1: the target's LM head shard (which module, which group, which rows).

A head is a ``VocabParallelEmbedding``'s own shard, or a row slice of a table that every rank holds
whole (Gemma 3's tied ``nn.Embedding``, which its ``get_embed_and_head`` slices per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.amx_utils import PackWeightMethod
from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.runtime_context import get_parallel

from sglang_frspec.adapters.quantized_head import check_quantized_head_readable, read_quantized_rows
from sglang_frspec.core import HotShardPlan, UnsupportedSetupError, build_head_from_table, table_slice_ranges
from sglang_frspec.core.gather import AllGather, RowReader, place_hot_rows, shard_row_reader

_SLICEABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PLAIN_HEAD_TENSORS = {"weight", "bias"}  # an unquantized head (its bias is not used for logits)


@dataclass(frozen=True)
class HeadShard:
    """Where this rank's rows of the target LM head sit in the vocab, and who shares them."""

    module: torch.nn.Module  # the VocabParallelEmbedding, or the module of a replicated table
    group_name: str | None  # "tp" or "attn_tp"; None when the head is not sharded
    rank: int
    shard_ranges: tuple[tuple[int, int], ...]  # original-vocab range of every rank
    vocab_size: int  # original vocab (ids at or above it are padding or LoRA rows)
    replicated: bool = False  # module.weight is the whole [vocab, hidden] table on every rank

    @property
    def tp_size(self) -> int:
        return len(self.shard_ranges)

    @property
    def all_gather(self) -> AllGather:
        """All-gather over the group that shards the head; None when nothing is sharded."""
        return self._all_gather if self.group_name else None

    def _all_gather(self, output: torch.Tensor, local: torch.Tensor) -> None:
        # Looked up per call: SGLang may patch the parallel groups around draft forwards.
        getattr(get_parallel(), f"{self.group_name}_group").all_gather_into_tensor(output, local)


def find_head_shard(target_model: torch.nn.Module, head: torch.Tensor) -> HeadShard:
    """This rank's shard of the target LM head ``head`` (the layout must come from its owner): a
    ``VocabParallelEmbedding`` whose weight it is, or a table of which it is a row slice."""
    modules = [m for m in target_model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    for module in modules:
        if isinstance(module, VocabParallelEmbedding) and (
            module.weight is head or module.weight.data_ptr() == head.data_ptr()
        ):
            return describe_head_shard(module)
    for module in modules:
        table = module.weight
        if not isinstance(module, VocabParallelEmbedding) and _row_slice_start(table, head) is not None:
            return describe_table_slice(module, head)
    raise UnsupportedSetupError(
        f"sglang-frspec could not find the module of {type(target_model).__name__} that owns the "
        "LM head shared with the draft (a vocab-parallel embedding, or a table the head is a row "
        "slice of), so the vocab shard of each rank is unknown. Serve this model without "
        "--speculative-token-map, or at --tp-size 1."
    )


def _row_slice_start(table: torch.Tensor, head: torch.Tensor) -> int | None:
    """The first row of ``table`` that ``head`` views, when ``head`` is a run of its whole rows."""
    if table.dim() != 2 or head.dim() != 2 or head.dtype != table.dtype or head.device != table.device:
        return None
    if head.shape[1] != table.shape[1] or head.stride() != table.stride():
        return None
    if head.untyped_storage().data_ptr() != table.untyped_storage().data_ptr():
        return None
    start, partial = divmod(head.storage_offset() - table.storage_offset(), table.stride(0))
    return start if not partial and start >= 0 and start + head.shape[0] <= table.shape[0] else None


def describe_table_slice(module: torch.nn.Module, head: torch.Tensor) -> HeadShard:
    """The shard of a head that is this rank's row slice of ``module.weight``, a table every rank
    holds whole: the group it was sliced over and every rank's rows (``table_slice_ranges``,
    checked against this rank's own slice; no collective)."""
    vocab = module.weight.shape[0]
    start = _row_slice_start(module.weight, head)
    own = (start, start + head.shape[0])
    if own == (0, vocab):  # the whole table (a draft whose embedding is not vocab-parallel)
        return HeadShard(module, None, 0, (own,), vocab, replicated=True)
    parallel = get_parallel()
    for group_name in ("tp", "attn_tp"):
        rank, size = getattr(parallel, f"{group_name}_rank"), getattr(parallel, f"{group_name}_size")
        ranges = table_slice_ranges(vocab, size)
        if size > 1 and ranges[rank] == own:
            return HeadShard(module, group_name, rank, ranges, vocab, replicated=True)
    raise UnsupportedSetupError(
        f"the LM head shared with the draft is rows [{own[0]}, {own[1]}) of the {vocab}-row table "
        f"of {type(module).__name__}, which every rank holds whole, but no even slice of it over the "
        "tp or attn_tp group gives this rank those rows (rank r of n holds rows [r*ceil(V/n), "
        "(r+1)*ceil(V/n))), so the other ranks' rows are unknown. Serve this model without "
        "--speculative-token-map, or at --tp-size 1."
    )


def check_head_supported(module: torch.nn.Module) -> None:
    """Reject heads whose rows are neither plain floating-point rows (of the vocab shard, or of a
    table every rank holds whole) nor quantized vocab-shard rows in a layout the plugin reads back."""
    weight = getattr(module, "weight", None)  # quantized heads keep e.g. `qweight` instead
    # On an AMX CPU SGLang swaps a bf16/fp16 head's method to PackWeightMethod: packed, not quantized.
    if (
        isinstance(getattr(module, "quant_method", None), PackWeightMethod)
        or getattr(weight, "is_gguf_weight_type", False)
        or getattr(module, "use_intel_amx_backend", False)
    ):
        raise UnsupportedSetupError(
            "the target LM head weight is packed (GGUF or CPU AMX/VNNI layout), so its rows "
            "cannot be sliced. Use a safetensors checkpoint (not --load-format gguf) or drop "
            "--speculative-token-map."
        )
    # Judged by what the module holds, not by its method's class: SGLang gives a head that the
    # checkpoint leaves unquantized UnquantizedEmbeddingMethod or UnquantizedLinearMethod.
    quantization_tensors = _quantization_tensors(module)
    if quantization_tensors and not isinstance(module, VocabParallelEmbedding):
        raise UnsupportedSetupError(
            f"the target LM head is a slice of the table of {type(module).__name__}, which holds "
            f"{', '.join(quantization_tensors)} besides plain rows; only plain rows of such a table "
            "can be sliced. Drop --speculative-token-map."
        )
    if quantization_tensors:
        check_quantized_head_readable(module, quantization_tensors)
        return
    if weight is None:
        raise UnsupportedSetupError(
            f"the target LM head ({type(module).__name__}) has no 'weight' tensor, so its rows "
            "cannot be sliced. Serve it without --speculative-token-map."
        )
    if weight.dtype not in _SLICEABLE_DTYPES or weight.dim() != 2:
        raise UnsupportedSetupError(
            f"the target LM head weight is {weight.dtype} with shape {tuple(weight.shape)}; "
            "FR-Spec needs a plain 2-D fp16/bf16/fp32 head. Drop --speculative-token-map."
        )
    if not isinstance(module, VocabParallelEmbedding):  # a whole table: the head is its row slice
        return
    if weight.shape[0] != module.num_embeddings_per_partition:
        raise UnsupportedSetupError(
            f"the target LM head has {weight.shape[0]} local rows but its vocab shard has "
            f"{module.num_embeddings_per_partition}; a packed or re-laid-out head cannot be "
            "sliced by token id. Drop --speculative-token-map."
        )
    if weight.shape[1] != module.embedding_dim:
        raise UnsupportedSetupError(
            f"the target LM head weight has {weight.shape[1]} columns but the hidden size is "
            f"{module.embedding_dim}; a transposed or packed head cannot be sliced by token id. "
            "Drop --speculative-token-map."
        )


def _quantization_tensors(module: VocabParallelEmbedding) -> list[str]:
    """The head's own parameters and buffers besides its rows (scales, zero points, packed weights)."""
    names = {name for name, _ in module.named_parameters(recurse=False)}
    names |= {name for name, _ in module.named_buffers(recurse=False)}
    return sorted(names - _PLAIN_HEAD_TENSORS)


def hot_row_reader(shard: HeadShard) -> RowReader:
    """Reads rows of this rank's vocab shard of a head ``check_head_supported`` accepted (row i is
    token ``shard_ranges[rank][0] + i``), into the destination's dtype: a plain head's rows as they
    are, a quantized head's dequantized."""
    module = shard.module
    if shard.replicated:  # the shard is this rank's slice of the whole table
        start, end = shard.shard_ranges[shard.rank]
        return shard_row_reader(module.weight.detach()[start:end])
    if not _quantization_tensors(module):
        return shard_row_reader(module.weight)

    def read(rows: torch.Tensor, dest: torch.Tensor) -> None:
        dest.copy_(read_quantized_rows(module, rows, dest.dtype))

    return read


def build_hot_head(
    shard: HeadShard, plan: HotShardPlan, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's hot head (as ``build_local_head``; ``out`` is refilled in place).

    A plain head's rows are taken as they are (in the head's dtype, as stock). A quantized head
    has only the hot rows this rank owns dequantized, into ``dtype``, a chunk at a time, never
    its whole shard.
    """
    module = shard.module
    if shard.replicated:  # every rank holds every row: no exchange under either layout
        return build_head_from_table(module.weight, plan, shard.rank, out=out)
    if out is None:
        dtype = dtype if _quantization_tensors(module) else module.weight.dtype
        out = module.weight.new_zeros((plan.width, module.embedding_dim), dtype=dtype)
    place_hot_rows(hot_row_reader(shard), plan.hot_ids, plan, shard.rank, shard.all_gather, out)
    return out


def quantized_head_bytes(module: VocabParallelEmbedding) -> int | None:
    """Bytes this rank's quantized head shard holds (weight and scales), what a full-vocab step
    streams; None for a plain head."""
    if not _quantization_tensors(module):
        return None
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def describe_head_shard(module: VocabParallelEmbedding) -> HeadShard:
    """Every rank's vocab range, computed with SGLang's own ``_get_indices`` (no collective)."""
    tp_size = module.tp_size if module.enable_tp else 1
    if tp_size == 1:
        return HeadShard(module, None, 0, ((0, module.org_vocab_size),), module.org_vocab_size)
    group_name = "attn_tp" if module.use_attn_tp_group else "tp"
    rank = getattr(get_parallel(), f"{group_name}_rank")
    indices = [
        type(module)._get_indices(
            module.num_embeddings_padded,
            module.org_vocab_size_padded,
            module.num_embeddings,
            module.org_vocab_size,
            r,
            tp_size,
        )
        for r in range(tp_size)
    ]
    ranges = tuple((i.org_vocab_start_index, i.org_vocab_end_index) for i in indices)
    own = module.shard_indices
    if ranges[rank] != (own.org_vocab_start_index, own.org_vocab_end_index):
        raise UnsupportedSetupError(
            f"rank {rank} of the {group_name} group holds vocab rows "
            f"[{own.org_vocab_start_index}, {own.org_vocab_end_index}) of the LM head, not "
            f"{list(ranges[rank])} as its group position implies; this head layout is not "
            "supported with --speculative-token-map."
        )
    return HeadShard(module, group_name, rank, ranges, module.org_vocab_size)


def check_draft_supported(draft_model: torch.nn.Module, num_hot: int) -> None:
    """Reject drafts whose head cannot be replaced by a separate hot head."""
    config = getattr(draft_model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        raise UnsupportedSetupError(
            "the draft model ties its LM head to its input embeddings (tie_word_embeddings "
            "in the draft's config.json), so a reduced hot head would also cut its embeddings. "
            "Use an untied EAGLE draft, or drop --speculative-token-map."
        )
    for field in ("draft_vocab_size", "hot_vocab_size"):
        declared = getattr(config, field, None)
        if declared is not None and declared != num_hot:
            raise UnsupportedSetupError(
                f"the draft config sets {field}={declared}, but the token map has {num_hot} "
                f"distinct ids; SGLang sizes draft buffers from {field}. Remove {field} from "
                "the draft's config.json or use a map of that size."
            )


def check_draft_uses_hot_head(draft_model: torch.nn.Module, local_head: torch.Tensor) -> None:
    """Reject drafts that keep their own LM head instead of taking the hot head.

    Some NEXTN/MTP drafts ignore ``set_embed_and_head`` (or keep a head they loaded), so their
    forward would pass a full-vocab head to the hot-logits processor: wrong columns, silently.
    Every ``ParallelLMHead`` of the draft must hold the hot head after ``set_embed_and_head``,
    and compute with it as a plain head.
    """
    heads = [(name, m) for name, m in draft_model.named_modules() if isinstance(m, ParallelLMHead)]
    own = [name or "(model)" for name, m in heads if getattr(m, "weight", None) is not local_head]
    if own or not heads:
        where = f"its own LM head ({', '.join(own)})" if own else "no ParallelLMHead"
        raise UnsupportedSetupError(
            f"the draft model {type(draft_model).__name__} keeps {where} after "
            "set_embed_and_head(), so it would not compute logits with the hot head and a token "
            "map would read the wrong columns. Serve this draft without "
            "--speculative-token-map (its set_embed_and_head must take the target's head)."
        )
    # A draft loaded with the target's quantization keeps its head's quant method; SGLang's logits
    # path would apply it to the plain hot head unless its own check skips it.
    quantized = [
        f"{name or '(model)'}: {type(m.quant_method).__name__}"
        for name, m in heads
        if should_apply_lm_head_quant_method(m, m.quant_method)
    ]
    if quantized:
        raise UnsupportedSetupError(
            f"the draft model {type(draft_model).__name__} computes its logits through a quantized "
            f"LM head method ({', '.join(quantized)}), which SGLang would apply to the plain hot head. "
            "Load the draft unquantized (--speculative-draft-model-quantization unquant), or drop "
            "--speculative-token-map."
        )
