"""A draft whose ``set_embed_and_head`` keeps its own LM head."""

from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle


class KeepsOwnHeadLlamaEagle(LlamaForCausalLMEagle):
    """Like step3p5_mtp: set_embed_and_head keeps the draft's own (full-vocab) head."""

    def set_embed_and_head(self, embed, head):
        return


EntryClass = KeepsOwnHeadLlamaEagle
