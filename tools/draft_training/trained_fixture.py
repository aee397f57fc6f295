"""A small Llama target and EAGLE draft trained on real text, for acceptance that means something.

The text is what every CPython install has: the standard library's top-level modules (code) and
``pydoc_data.topics`` (the language reference's prose), split by ``sglang_frspec.demo.texts`` (1 in
8 documents held out by a hash of its content; no held-out line in training): training topics
build the ``prose`` map, held-out ones give out-of-domain prompts. Everything is trained on CPU in
float32 with fixed seeds and cached under a hash of the text and of this builder's source.

Built here:
- a byte-level BPE tokenizer (32k vocab) trained on the training code;
- a Llama target (``LlamaForCausalLM``) trained on that code until its held-out loss is well below
  a unigram model's (checked: the build fails otherwise);
- an EAGLE draft (``LlamaForCausalLMEagle``, the target's embedding and head) trained on the
  target's final hidden states: regression on the next hidden state plus cross-entropy with the
  target's next-token distribution, EAGLE-1's objective, with one unrolled step on its own output;
- maps of ``MAP_SIZES`` from the training code (``code_<n>``), and ``prose_<n>`` from training prose.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import (
    ModelFixture,
    cache_root,
    cached_build,
    llama_config,
    save_model,
    source_digest,
)
from sglang_frspec.demo.texts import stdlib_texts, text_digest
from tools.draft_training.model import (
    LayerShape,
    draft_loss,
    first_step_agreement,
    head_loss,
    init_draft,
    init_layer,
    layer,
    rms_norm,
    train,
)

VOCAB = 32000
HIDDEN, LAYERS, HEADS, INTER = 128, 2, 4, 384
SEQ, BATCH = 128, 8
TARGET_STEPS, DRAFT_STEPS = 400, 200
EVAL_TOKENS = 32768  # held-out tokens the losses are measured on
# The greedy outputs of a model this small keep to a few hundred frequent ids (15-33 distinct ids in
# 384 tokens of held-out prompts), so acceptance changes below ~256 ids: the sizes span that range.
MAP_SIZES = (32, 128, 512, 2048)
PROSE_MAP_SIZE = 128
PROMPT_TOKENS = 32  # prompts are this many tokens of held-out text

BUILDER_DIGEST = source_digest(
    __name__, "tools.draft_training.model", "sglang_frspec.demo.fixtures", "sglang_frspec.demo.texts"
)


@dataclass(frozen=True)
class TrainedFixture(ModelFixture):
    """The trained target/draft, its maps (``token_map("code_128")``, ...), the training
    code's token counts (``counts``) and held-out prompts."""

    @property
    def counts(self) -> str:
        """Token counts of the training code (``build-map --save-counts`` format)."""
        return str(self.root / "counts_code.pt")

    @property
    def report(self) -> dict:
        """Sizes, losses and timings printed by the build (``report.json``)."""
        return json.loads((self.root / "report.json").read_text())

    def prompts(self, domain: str) -> list[list[int]]:
        """Held-out prompts (token ids) of ``domain``: ``code`` or ``prose``."""
        return json.loads((self.root / "prompts.json").read_text())[domain]


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts' ids in order, each followed by EOS (id 2)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [2]
    return torch.tensor(ids)


SHAPE = LayerShape(HIDDEN, HEADS, max(1, HEADS // 2), HIDDEN // HEADS, INTER)  # target and draft layers


def _target_hidden(p: dict, ids: torch.Tensor) -> torch.Tensor:
    """The target's final (normed) hidden states: what SGLang hands the EAGLE draft."""
    x = p["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        x = layer(p, f"model.layers.{i}.", x, SHAPE)
    return rms_norm(x, p["model.norm.weight"])


def _batches(stream: torch.Tensor, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - SEQ - 1, (BATCH,), generator=gen)
        yield torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()])


def _held_out_loss(p: dict, stream: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of the target over ``stream`` in SEQ windows."""
    stream = stream[: EVAL_TOKENS + 1]
    windows = stream[: (stream.numel() - 1) // SEQ * SEQ + 1]
    inputs = windows[:-1].view(-1, SEQ)
    labels = windows[1:].view(-1, SEQ)
    total = 0.0
    with torch.no_grad():
        for i in range(0, inputs.shape[0], BATCH):
            hidden = _target_hidden(p, inputs[i : i + BATCH])
            chunk = labels[i : i + BATCH]
            total += float(head_loss(hidden, p["lm_head.weight"], labels=chunk)) * chunk.numel()
    return total / labels.numel()


def _unigram_loss(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Held-out cross-entropy (nats) of add-one-smoothed training unigram frequencies."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[held_out[1 : EVAL_TOKENS + 1]].mean())


def _train_target(params: dict, stream: torch.Tensor, log) -> None:
    def loss_of(p: dict, batch: torch.Tensor) -> torch.Tensor:
        return head_loss(_target_hidden(p, batch[:, :-1]), p["lm_head.weight"], labels=batch[:, 1:])

    train(params, _batches(stream, TARGET_STEPS, seed=1), loss_of, TARGET_STEPS, 3e-3, log, label="target")


def _train_draft(draft: dict, target: dict, stream: torch.Tensor, log) -> None:
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    gen = torch.Generator().manual_seed(3)

    def loss_of(p: dict, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = _target_hidden(target, batch)  # [B, SEQ+1, H]
        return draft_loss(p, embed, head, batch, features, gen, SHAPE)

    train(draft, _batches(stream, DRAFT_STEPS, seed=2), loss_of, DRAFT_STEPS, 2e-3, log)


def _draft_agreement(draft: dict, target: dict, stream: torch.Tensor) -> float:
    """How often the draft's first-step argmax equals the target's greedy token (held-out code)."""
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    ids = stream[: (stream.numel() - 1) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1)[:8]
    with torch.no_grad():
        features = _target_hidden(target, ids)
    return float(first_step_agreement(draft, embed, head, ids, features, SHAPE).float().mean())


def _check_against_transformers(path: Path, params: dict, ids: torch.Tensor) -> None:
    """The saved target, loaded by HF transformers, gives the logits it was trained with."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours = _target_hidden(params, ids[None]) @ params["lm_head.weight"].T
        theirs = model(ids[None]).logits
    error = (ours - theirs).abs().max().item()
    assert error < 1e-3, f"trained target and its checkpoint disagree (max |logit diff| {error:.2e})"


def _build(root: Path, texts: tuple[list[str], ...]) -> None:
    from sglang_frspec.maps.build import build_token_map, rebuild_token_map

    train_code, held_code, prose_map, prose_prompts = texts
    root.mkdir(parents=True)
    started = time.monotonic()
    report: dict = {}
    lines: list[str] = []

    def log(message: str) -> None:
        line = f"[trained fixture {time.monotonic() - started:6.1f}s] {message}"
        lines.append(line)
        print(line, file=sys.stderr, flush=True)

    torch.manual_seed(0)
    target_dir, draft_dir = root / "target", root / "draft"
    tokenizer = _train_tokenizer(train_code)
    train_stream, held_stream = _token_stream(tokenizer, train_code), _token_stream(tokenizer, held_code)
    report |= {
        "vocab": len(tokenizer),
        "train_tokens": train_stream.numel(),
        "held_out_tokens": held_stream.numel(),
    }
    log(f"tokenizer: {len(tokenizer)} ids; " + ", ".join(f"{k} {v}" for k, v in report.items()))

    gen = torch.Generator().manual_seed(0)
    target = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
    }
    for i in range(LAYERS):
        init_layer(target, f"model.layers.{i}.", gen, input_ln=True, shape=SHAPE)
    _train_target(target, train_stream, log)
    target = {k: v.detach() for k, v in target.items()}
    held_loss, unigram = _held_out_loss(target, held_stream), _unigram_loss(train_stream, held_stream)
    report |= {"target_held_out_loss": held_loss, "unigram_held_out_loss": unigram}
    log(f"target held-out loss {held_loss:.3f} nats vs unigram {unigram:.3f}")
    if held_loss > unigram - 1.0:
        raise RuntimeError(
            f"trained target is not clearly better than unigram ({held_loss:.3f} vs {unigram:.3f})"
        )
    cfg = llama_config("LlamaForCausalLM", VOCAB, HIDDEN, LAYERS, INTER, HEADS)
    save_model(target_dir, target, cfg)
    tokenizer.save_pretrained(str(target_dir))
    _check_against_transformers(target_dir, target, held_stream[:64])

    draft = init_draft(HIDDEN, SHAPE, gen)
    _train_draft(draft, target, train_stream, log)
    agreement = _draft_agreement(draft, target, held_stream)
    report["draft_top1_agreement"] = agreement
    log(f"draft step-1 agreement with the target's greedy token (held-out code): {agreement:.1%}")
    draft = {k: v.detach() for k, v in draft.items()}
    draft |= {
        "embed_tokens.weight": target["model.embed_tokens.weight"],
        "lm_head.weight": target["lm_head.weight"],
    }
    save_model(draft_dir, draft, llama_config("LlamaForCausalLMEagle", VOCAB, HIDDEN, 1, INTER, HEADS))

    corpus = root / "corpus"
    corpus.mkdir()
    for name, docs in (("code", train_code), ("prose", prose_map)):
        with open(corpus / f"{name}.jsonl", "w") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    _, code_counts = build_token_map(str(target_dir), [corpus / "code.jsonl"], MAP_SIZES[0], progress=False)
    code_counts.save(root / "counts_code.pt")
    for size in MAP_SIZES:
        torch.save(rebuild_token_map(code_counts, size), root / f"map_code_{size}.pt")
    prose_ids, _ = build_token_map(str(target_dir), [corpus / "prose.jsonl"], PROSE_MAP_SIZE, progress=False)
    torch.save(prose_ids, root / f"map_prose_{PROSE_MAP_SIZE}.pt")
    code_coverage = code_counts.best_coverage(MAP_SIZES)
    report["training_text_coverage"] = code_coverage
    log(f"maps {list(MAP_SIZES)} (code), {PROSE_MAP_SIZE} (prose); training-text coverage {code_coverage}")

    prose_stream = _token_stream(tokenizer, prose_prompts)
    prompts = {
        domain: [stream[i : i + PROMPT_TOKENS].tolist() for i in range(0, 64 * 97, 97)]
        for domain, stream in (("code", held_stream), ("prose", prose_stream))
    }
    (root / "prompts.json").write_text(json.dumps(prompts))
    report["build_seconds"] = time.monotonic() - started
    (root / "build.log").write_text("\n".join(lines) + "\n")
    (root / "report.json").write_text(json.dumps(report, indent=1))


def trained_fixture() -> TrainedFixture:
    """Build (once, cached by text and builder hash) and return the trained fixture."""
    texts = stdlib_texts()
    root = cached_build(
        cache_root() / f"trained-{BUILDER_DIGEST}-{text_digest(*texts)}",
        lambda path: _build(path, texts),
        marker="report.json",
    )
    return TrainedFixture(root)
