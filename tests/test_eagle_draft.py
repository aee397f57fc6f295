"""The plain-torch EAGLE draft the drafts are trained with, and the shipped Gemma 3 draft's files.

The draft forward of ``tools/draft_training/model.py`` must compute what SGLang's
``LlamaForCausalLMEagle`` computes, or served acceptance falls below offline agreement. It is
compared with Transformers' Llama layer (the conventions SGLang's Llama loads checkpoints by:
neox rotary, GQA, an explicit ``head_dim``), with the first layer's input norm and the model's
final norm removed as SGLang's EAGLE class removes them (``llama_eagle.py:55, 110-114``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.draft_training.model import LayerShape, draft_chains, draft_hidden, init_draft, save_eagle_draft

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "sglang_frspec" / "demo" / "gemma3_draft"


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_forward_equals_transformers_llama_layers_without_first_input_and_final_norm(layers):
    from transformers import LlamaConfig, LlamaModel

    # head_dim != hidden / heads, GQA, a non-default rope theta and eps: each is a way to differ.
    cfg = {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 80,
        "rope_theta": 5000.0,
        "rms_norm_eps": 1e-5,
    }
    shape = LayerShape.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    draft = init_draft(48, shape, gen, layers)
    for name in [k for k in draft if k.endswith("layernorm.weight")]:
        draft[name] = torch.rand(48, generator=gen) + 0.5
    embed = torch.randn(100, 48, generator=gen)
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    features = torch.randn(2, 12, 48, generator=gen)

    hf = LlamaModel(LlamaConfig(**cfg, vocab_size=100, num_hidden_layers=layers, attn_implementation="eager"))
    for i in range(layers):
        weights = {
            k.removeprefix(f"layers.{i}."): v for k, v in draft.items() if k.startswith(f"layers.{i}.")
        }
        hf.layers[i].load_state_dict(weights, strict=i > 0)
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    fc = torch.cat([embed[ids], features], -1) @ draft["fc.weight"].T + draft["fc.bias"]
    with torch.no_grad():
        theirs = hf(inputs_embeds=fc).last_hidden_state
        ours = draft_hidden(draft, embed, ids, features, shape)
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_chains_equal_the_chain_drafted_position_by_position(layers):
    """``draft_chains`` drafts every position's chain at once; each row must be the chain the
    draft proposes when run from that prefix alone, step by step, each step reading the last
    step's id and output (the forward over the whole extended sequence, as SGLang's draft runs
    without a cache). Random weights, GQA, a hot head of 40 of 100 ids."""
    shape = LayerShape(48, 4, 2, 16, 80, rope_theta=5000.0, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    draft = init_draft(48, shape, gen, layers)
    embed, features = torch.randn(100, 48, generator=gen), torch.randn(14, 48, generator=gen)
    ids = torch.randint(0, 100, (14,), generator=gen)
    hot = torch.randperm(100, generator=gen)[:40].sort().values
    head = torch.randn(40, 48, generator=gen)
    steps = 3
    chains = draft_chains(draft, embed, head, hot, ids, features, shape, steps)
    assert chains.shape == (14, steps)
    for b in range(14):
        tokens, feats, drafted = ids[: b + 1], features[: b + 1], []
        for _ in range(steps):
            out = draft_hidden(draft, embed, tokens[None], feats[None], shape)[0, -1]
            drafted.append(int(hot[(out @ head.T).argmax()]))
            tokens, feats = torch.cat([tokens, torch.tensor([drafted[-1]])]), torch.cat([feats, out[None]])
        assert chains[b].tolist() == drafted, b


def test_shipped_gemma3_draft_is_small_complete_and_servable_at_tp2():
    from safetensors import safe_open

    config = json.loads((SHIPPED / "config.json").read_text())
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 12 * 2**20  # package data: 11 MB in bfloat16
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["vocab_size"] == 262144  # Gemma 3's; SGLang gives the draft its embedding and head
    # Gemma 3 270M's ids and context: SGLang refuses a draft whose context is shorter.
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["max_position_embeddings"] == 32768
    shape = LayerShape.from_config(config)
    assert shape.heads % 2 == 0 and shape.kv_heads % 2 == 0  # served at TP=2
    layers = config["num_hidden_layers"]
    expected = {k: v.shape for k, v in init_draft(shape.hidden, shape, torch.Generator(), layers).items()}
    with safe_open(str(weights), "pt") as f:
        shipped = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {k: v.shape for k, v in shipped.items()} == expected  # no embed_tokens or lm_head
    assert all(v.dtype == torch.bfloat16 and v.isfinite().all() for v in shipped.values())
    report = json.loads((SHIPPED / "training.json").read_text())
    assert report["draft"]["parameters"] == sum(v.numel() for v in shipped.values())
    assert report["draft"]["inter"] == shape.inter and report["hot_head"] == 32768


def test_training_pipeline_learns_a_tiny_target_and_resumes_to_the_same_draft(tmp_path, request):
    """Every stage of the shipped draft's pipeline (``tools/draft_training/run.py``) on the small
    permutation fixture, whose target continues any hot id x with pi(x): the trained draft agrees
    with the target on held-out continuations where the untrained one does not, the offline chain
    then accepts every draft, and a run stopped half-way and resumed ends at the same draft, bit
    for bit, as a run that never stopped."""
    from sglang_frspec.demo.fixtures import perm_fixture
    from tools.draft_training.run import DraftRun, held_out_digest

    fixture = perm_fixture(vocab_size=512, hidden_size=64, num_hot=64)
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(1)  # a model this small: one thread is fastest (two crawl on a loaded machine)
    chain = " ".join(f"w{i}" for i in fixture.chain)  # stays inside the hot set

    # Held out: the chain's words in a seeded random order, a text never trained on. The target
    # continues each word x with pi(x), so a held-out continuation is 7 scored positions of that
    # text (a draft trained on the chain alone need not get them) and 16 that follow the chain.
    order = torch.randint(len(fixture.chain), (256,), generator=torch.Generator().manual_seed(0))
    words = [f"w{fixture.chain[i]}" for i in order.tolist()]
    four_word_runs = [f" {' '.join(words[i : i + 4])} " for i in range(len(words) - 3)]
    assert not [r for r in four_word_runs if r in f" {chain} "]  # never trained on
    domains = {"chain": ([chain], [" ".join(words)])}
    shape = LayerShape(64, 2, 2, 32, 128)

    def run(work: Path, checkpoint: str = "checkpoint.pt", **more) -> DraftRun:
        target, token_map = Path(fixture.target), Path(fixture.token_map())
        return DraftRun(work, target, token_map, shape, log=lambda _: None, checkpoint=checkpoint, **more)

    def prepare(work: Path) -> DraftRun:
        r = run(work)
        r.corpus(domains, seq=24, prompt=8, gen_seqs=24, text_seqs=24, eval_seqs=4)
        r.generate(batch=16)
        r.features(topk=4, shard=16)
        return r

    train = dict(batch=4, lr=1e-2, ce_weight=1.0, unroll=2, save_every=3)
    whole = prepare(tmp_path / "whole")
    whole.train(epochs=2.0, stop_at=0, **train)  # no step yet: the untrained draft
    before = whole.evaluate(steps=3)
    whole.train(epochs=2.0, **train)
    after = whole.evaluate(steps=3)

    agree = after["held_out_top1_agreement"]["chain_generated"]["agreement"]
    assert before["held_out_top1_agreement"]["chain_generated"]["agreement"] < 0.3
    assert agree > 15 / 23  # the 16 positions that follow the chain, about
    offline = after["offline_chain"]["chain_generated"]
    assert offline["tokens_per_verify"] > 3.5  # 4 at most, after the prompt
    # the same chains cut to 1 and 2 steps: at most 2 and 3 tokens per verify, all accepted here
    by_steps = offline["tokens_per_verify_by_steps"]
    assert by_steps[3] == offline["tokens_per_verify"] and 1.8 < by_steps[1] <= 2 < by_steps[2] <= 3
    assert after["data"]["steps"] == 24  # 2 epochs of 48 sequences in batches of 4
    # the training's own settings, not the evaluating command's defaults
    settings = dict(batch=4, epochs=2.0, lr=1e-2, ce_weight=1.0, unroll=2, layers=1, init=None)
    assert after["training_settings"] == settings
    # Both halves of the training data took part: 24 windows of text, 24 continuations.
    assert after["data"]["text_windows"] == 24 and after["data"]["generated_sequences"] == 24

    # More data from a second run (continuations only, its own seed) trains beside the first's:
    # 8 more sequences, 14 steps an epoch instead of 12; held-out sets stay the first run's.
    more = run(tmp_path / "more", seed=1)
    more.corpus(domains, seq=24, prompt=8, gen_seqs=8, text_seqs=0, eval_seqs=4)
    more.generate(batch=16)
    more.features(topk=4, shard=16)
    both = run(whole.work, checkpoint="both.pt", more_data=(more.work,))
    both.train(epochs=1.0, init=whole.work / whole.checkpoint, **train)
    data = both.evaluate(steps=3)["data"]
    assert data["steps"] == 14 and data["folders"] == ["whole", "more"]
    assert data["text_windows"] == 24 and data["generated_sequences"] == 32
    # A run that held out other text is refused as more data and as a warm start: it may have
    # trained on this run's held-out text.
    other = run(tmp_path / "other")
    other.corpus({"chain": ([chain], [" ".join(words[:128])])}, seq=24, prompt=8, gen_seqs=8, text_seqs=0,
                 eval_seqs=4)  # fmt: skip
    assert held_out_digest(other.work) != held_out_digest(whole.work) == held_out_digest(more.work)
    with pytest.raises(ValueError, match="held out other text.*train from scratch"):
        run(whole.work, checkpoint="x.pt", more_data=(other.work,)).train(epochs=1.0, **train)
    with pytest.raises(ValueError, match="as a warm start it held out other text"):
        run(whole.work, checkpoint="x.pt").train(epochs=1.0, init=other.work / "checkpoint.pt", **train)

    stopped = prepare(tmp_path / "stopped")
    stopped.train(epochs=2.0, stop_at=11, **train)  # a run stopped after 11 of 24 steps
    run(tmp_path / "stopped").train(epochs=2.0, **train)
    resumed, straight = stopped.trained_draft(), whole.trained_draft()
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # A warm start (an ablation beside the first run, on the same data): its own checkpoint, the
    # first run's weights before any step; then trained on, and the first run's checkpoint kept.
    warm = run(tmp_path / "stopped", checkpoint="warm.pt")
    warm.train(epochs=1.0, stop_at=0, init=whole.work / whole.checkpoint, **train)
    untrained = warm.trained_draft()
    assert all(torch.equal(untrained[k], straight[k]) for k in straight)
    warm.train(epochs=1.0, init=whole.work / whole.checkpoint, **train | {"lr": 1e-3})
    warm_report = warm.evaluate(steps=3)
    assert warm_report["data"]["steps"] == 12
    init = str(whole.work / whole.checkpoint)
    assert warm_report["training_settings"] == settings | {"epochs": 1.0, "lr": 1e-3, "init": init}
    trained, kept = warm.trained_draft(), stopped.trained_draft()
    assert not all(torch.equal(trained[k], straight[k]) for k in straight)
    assert all(torch.equal(kept[k], straight[k]) for k in straight)

    # A warm start from a saved draft folder (the shipped draft): its bfloat16 weights, as saved.
    folder = tmp_path / "saved_draft"
    save_eagle_draft(folder, trained, json.loads((Path(fixture.target) / "config.json").read_text()), shape)
    from_folder = run(tmp_path / "stopped", checkpoint="from_folder.pt")
    with pytest.raises(ValueError, match="recorded no held-out digest"):
        from_folder.train(epochs=1.0, stop_at=0, init=folder, **train)
    # what scripts/train_gemma3_draft.py's evaluate stage records beside the draft
    record = {"manifest": {"held_out_digest": held_out_digest(whole.work)}}
    (folder / "training.json").write_text(json.dumps(record))
    from_folder.train(epochs=1.0, stop_at=0, init=folder, **train)
    loaded = from_folder.trained_draft()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)

    # A deeper draft warm-started from it: a second layer that starts as the identity, saved as a
    # two-layer LlamaForCausalLMEagle.
    deeper = run(tmp_path / "stopped", checkpoint="deeper.pt")
    deeper.train(epochs=1.0, stop_at=0, init=folder, layers=2, **train)
    grown = deeper.trained_draft()
    second = {k.replace("layers.0.", "layers.1.") for k in loaded if k.startswith("layers.0.")}
    assert grown.keys() - loaded.keys() == second | {"layers.1.input_layernorm.weight"}
    embed = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    ids, feats = torch.randint(0, 512, (2, 10)), torch.randn(2, 10, 64)
    one, two = ({k: v.float() for k, v in d.items()} for d in (loaded, grown))
    assert torch.equal(
        draft_hidden(two, embed, ids, feats, shape), draft_hidden(one, embed, ids, feats, shape)
    )
    deeper.train(epochs=1.0, init=folder, layers=2, **train | {"lr": 1e-3})
    assert deeper.trained_draft()["layers.1.mlp.down_proj.weight"].abs().max() > 0  # it trains
    target_cfg = json.loads((Path(fixture.target) / "config.json").read_text())
    save_eagle_draft(tmp_path / "deeper", deeper.trained_draft(), target_cfg, shape)
    assert json.loads((tmp_path / "deeper" / "config.json").read_text())["num_hidden_layers"] == 2


def test_hot_head_loss_and_gradient_equal_autograd_over_the_full_softmax():
    from tools.draft_training.run import ROW_CHUNK, sparse_head_loss

    gen = torch.Generator().manual_seed(0)
    rows, hidden, hot, k = ROW_CHUNK + 300, 64, 3000, 4  # two chunks, the second partial
    out = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    head = (torch.randn(hot, hidden, generator=gen) / 4).bfloat16()
    top = torch.stack([torch.randperm(hot, generator=gen)[:k] for _ in range(rows)])  # distinct ids
    probs = torch.rand(rows, k, generator=gen).half()

    loss = sparse_head_loss(out.view(2, -1, hidden), head, top.view(2, -1, k), probs.view(2, -1, k))
    loss.backward()
    fused = out.grad.clone()

    # Reference: plain autograd over the full float32 log-softmax of the same bfloat16 products.
    out.grad = None
    log_q = (out.bfloat16().float() @ head.float().T).log_softmax(-1)
    target = probs.float() / probs.float().sum(-1, keepdim=True)
    reference = -(target * log_q.gather(1, top)).sum(-1).mean()
    reference.backward()
    assert torch.allclose(loss, reference, rtol=1e-4)
    # The fused gradient goes through one bfloat16 matmul more (dlogits @ head), as autograd's did
    # through the bfloat16 product: within a few of bfloat16's 2^-8 in norm.
    assert (fused - out.grad).norm() < out.grad.norm() * 2**-6
