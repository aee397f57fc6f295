"""Tiny local models for tests, benchmarks and the CPU demo (no model hub needed).

The permutation fixture makes acceptance assertable. The target (LlamaForCausalLM) has zero
o_proj/down_proj, so its final hidden state is RMSNorm(embed(x)); embeddings are unit vectors
and ``lm_head[j] = embed[pi^-1(j)]``, so greedy decoding follows x -> pi(x). The EAGLE draft
(LlamaForCausalLMEagle, fc = [I | 0], zeroed output projections) sees embed(x) and, through
the target's shared head, also predicts pi(x): every draft token is accepted. pi cycles the
hot set within itself (and the cold set within itself), so a chain that starts hot stays hot.
The hot set holds two cycles: a small one inside rank 0's TP=2 half (``low_chain``, so the
``hot_low`` map keeps full acceptance) and one crossing both halves (``chain``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_frspec.core.plan import vocab_shard_ranges

LLAMA3_VOCAB = 128256


def source_digest(*modules: str) -> str:
    """Short sha256 of these modules' source files: part of every cached fixture's name, so any
    change to a builder (or a helper it calls) builds a fresh copy instead of reusing a stale one."""
    import importlib.util

    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(importlib.util.find_spec(module).origin).read_bytes())
    return digest.hexdigest()[:12]


BUILDER_DIGEST = source_digest(__name__)


def cache_root() -> Path:
    """Where built fixtures are kept (``SGLANG_FRSPEC_CACHE`` overrides)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-frspec"
    return Path(os.environ.get("SGLANG_FRSPEC_CACHE", default)) / "fixtures"


@dataclass(frozen=True)
class ModelFixture:
    """A target, its EAGLE draft and token maps in one folder."""

    root: Path

    @property
    def target(self) -> str:
        return str(self.root / "target")

    @property
    def draft(self) -> str:
        return str(self.root / "draft")

    def token_map(self, name: str = "hot") -> str:
        return str(self.root / f"map_{name}.pt")


@dataclass(frozen=True)
class PermFixture(ModelFixture):
    """The permutation fixture: greedy decoding follows x -> pi(x).

    Maps (``token_map(name)``): hot (ids on both TP=2 halves), hot_low (all in rank 0's half),
    hot_half (a random half of the hot set: partial acceptance), hot_list (FR-Spec's format: a
    Python list in frequency order, EOS repeated), cold (disjoint from the hot set).
    """

    vocab_size: int = 0
    hidden_size: int = 0
    chain: tuple[int, ...] = ()  # pi chain crossing both TP=2 halves (greedy output of any prefix)
    low_chain: tuple[int, ...] = ()  # pi chain inside rank 0's TP=2 half


def _unit_rows(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.randn(n, dim, generator=gen)
    return rows / rows.norm(dim=1, keepdim=True)


def llama_config(arch: str, vocab: int, hidden: int, layers: int, inter: int, heads: int):
    return {
        "architectures": [arch],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": hidden // heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def decoder_layer(
    prefix: str, cfg: dict, gen: torch.Generator, input_ln: bool, output_scale: float = 0.0
) -> dict:
    """One Llama layer; with ``output_scale`` 0 its attention and MLP outputs are zero (the
    residual passes through), else its output projections are random of that scale."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim, kv = cfg["head_dim"], cfg["num_key_value_heads"]
    q = cfg["num_attention_heads"] * head_dim
    tensors = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(q, hidden, generator=gen) * 0.05,
        f"{prefix}self_attn.k_proj.weight": torch.randn(kv * head_dim, hidden, generator=gen) * 0.05,
        f"{prefix}self_attn.v_proj.weight": torch.randn(kv * head_dim, hidden, generator=gen) * 0.05,
        f"{prefix}self_attn.o_proj.weight": torch.randn(hidden, q, generator=gen) * output_scale,
        f"{prefix}mlp.gate_proj.weight": torch.randn(inter, hidden, generator=gen) * 0.05,
        f"{prefix}mlp.up_proj.weight": torch.randn(inter, hidden, generator=gen) * 0.05,
        f"{prefix}mlp.down_proj.weight": torch.randn(hidden, inter, generator=gen) * output_scale,
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
    }
    if input_ln:
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
    return tensors


def save_model(path: Path, tensors: dict, config: dict) -> None:
    """A model folder SGLang loads: float32 safetensors, config.json, generation_config.json."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(
        {k: v.float().contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace WordLevel tokenizer over tokens <unk>, <s>, </s>, w3 .. w{V-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    ).save_pretrained(str(path))


def _build_perm(root: Path, vocab: int, hidden: int, num_hot: int, seed: int) -> None:
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    (lo_start, lo_end), (hi_start, hi_end) = vocab_shard_ranges(vocab, 2)
    half = num_hot // 2
    # Hot ids on both TP=2 halves: the frequent low ids plus a random spread above the split.
    upper = hi_start + torch.randperm(hi_end - hi_start, generator=gen)[: num_hot - half]
    hot = torch.unique(torch.cat([torch.arange(3, 3 + half), upper]))
    cold_mask = torch.ones(vocab, dtype=torch.bool)
    cold_mask[hot] = False
    cold_mask[:3] = False  # keep <unk>, <s>, </s> out of the cycles' way
    cold = torch.nonzero(cold_mask).flatten()
    low_cycle = torch.arange(3, 3 + half)[torch.randperm(half, generator=gen)[: half // 4]]
    cross_mask = torch.ones(vocab, dtype=torch.bool)
    cross_mask[low_cycle] = False
    cross_cycle = hot[cross_mask[hot]]
    pi = torch.arange(vocab)
    for ids in (low_cycle, cross_cycle, cold):  # one random cycle inside each set
        order = ids[torch.randperm(ids.numel(), generator=gen)]
        pi[order] = torch.roll(order, -1)
    inverse = torch.empty_like(pi)
    inverse[pi] = torch.arange(vocab)
    embed = _unit_rows(vocab, hidden, gen)
    head = embed[inverse].clone()  # head[j] = embed[pi^-1(j)]: greedy next(x) = pi(x)

    inter, heads = 2 * hidden, max(1, hidden // 32)
    target_cfg = llama_config("LlamaForCausalLM", vocab, hidden, 2, inter, heads)
    target = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": head,
    }
    for i in range(2):
        target |= decoder_layer(f"model.layers.{i}.", target_cfg, gen, input_ln=True)
    save_model(root / "target", target, target_cfg)
    save_word_tokenizer(root / "target", vocab)

    draft_cfg = llama_config("LlamaForCausalLMEagle", vocab, hidden, 1, inter, heads)
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    draft = {
        "embed_tokens.weight": embed,
        "fc.weight": fc,
        "fc.bias": torch.zeros(hidden),
        "lm_head.weight": head,
    }
    draft |= decoder_layer("layers.0.", draft_cfg, gen, input_ln=False)
    save_model(root / "draft", draft, draft_cfg)

    torch.save(hot, root / "map_hot.pt")
    torch.save(hot[hot < lo_end], root / "map_hot_low.pt")
    torch.save(hot[torch.randperm(hot.numel(), generator=gen)[: hot.numel() // 2]], root / "map_hot_half.pt")
    torch.save(cold[:num_hot].clone(), root / "map_cold.pt")
    # FR-Spec publishes Python lists in frequency order with EOS forced in (here: repeated).
    freq_order = hot[torch.randperm(hot.numel(), generator=gen)].tolist()
    torch.save([2, *freq_order, 2], root / "map_hot_list.pt")

    def follow(start: int, length: int) -> list[int]:
        ids = [start]
        while len(ids) < length:
            ids.append(int(pi[ids[-1]]))
        return ids

    chain = follow(int(cross_cycle[cross_cycle >= hi_start][0]), 1024)  # wraps around the cycle
    low_chain = follow(int(low_cycle[0]), 256)
    (root / "chains.json").write_text(
        json.dumps({"chain": chain, "low_chain": low_chain, "num_hot": len(hot)})
    )

    # The fixture's promise, checked with plain torch: target and hot-restricted draft
    # both map x -> pi(x).
    x = torch.tensor(chain[:8] + low_chain[:8])
    normed = embed[x] * hidden**0.5  # RMSNorm of a unit vector
    assert torch.equal((normed @ head.T).argmax(-1), pi[x]), "target step is not pi"
    assert torch.equal(hot[(embed[x] @ head[hot].T).argmax(-1)], pi[x]), "draft step is not pi"


def cached_build(root: Path, build: Callable[[Path], None], marker: str) -> Path:
    """Build ``root`` once: ``build(staging)`` fills a fresh folder, renamed into place when done.

    ``marker`` is a file ``build`` writes last; its presence means a complete earlier build.
    Concurrent callers (the test suite's background builds and the test that needs one) build it
    once: the others wait on a lock file beside it, then find the marker.
    """
    if (root / marker).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released at close, and by the kernel if this process dies
        if not (root / marker).exists():
            staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
            try:
                build(staging / "build")
                (staging / "build").rename(root)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return root


def linked_variant(source: Path, suffix: str, edit: Callable[[Path], None], marker: str) -> Path:
    """A variant of the fixture folder ``source`` beside it (``<name>-<suffix>``, built once): its
    files hard links to ``source``'s (no second copy of the weights), then ``edit(variant)``. An edit
    replaces a file it changes (unlink, then write): writing through a link changes ``source``."""

    def build(root: Path) -> None:
        shutil.copytree(source, root, copy_function=os.link)
        edit(root)

    return cached_build(source.with_name(f"{source.name}-{suffix}"), build, marker)


def perm_fixture(
    vocab_size: int = 32000, hidden_size: int = 128, num_hot: int = 512, seed: int = 1234
) -> PermFixture:
    """Build (once, cached) and return the permutation fixture for these sizes."""
    root = cached_build(
        cache_root() / f"perm-{BUILDER_DIGEST}-v{vocab_size}-h{hidden_size}-n{num_hot}-s{seed}",
        lambda path: _build_perm(path, vocab_size, hidden_size, num_hot, seed),
        marker="chains.json",
    )
    chains = json.loads((root / "chains.json").read_text())
    return PermFixture(
        root=root,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        chain=tuple(chains["chain"]),
        low_chain=tuple(chains["low_chain"]),
    )
