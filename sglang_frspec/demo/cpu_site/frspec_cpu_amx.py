"""CPU-test-only SGLang plugin: report AMX so `--attention-backend intel_amx` is kept.

SGLang downgrades intel_amx to torch_native on CPUs without AMX, and torch_native has no EAGLE
support. The layers still run torch-native code; the attention ops come from the sgl_kernel
stand-in beside this file.
"""


def register() -> None:
    import torch
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()
    if not torch.cuda.is_available():
        # DeepSeek's set_embed_and_head (sglang/srt/models/deepseek_v2.py:3448, run when a NextN
        # draft takes the target's head) synchronizes CUDA unconditionally: nothing to wait for here.
        torch.cuda.synchronize = lambda device=None: None
