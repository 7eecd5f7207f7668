"""Tiny randomly initialised targets for fast CPU tests: Llama (GQA) and DeepSeek-V3 (MLA + MoE).

``make_tiny(kind, seed)`` returns an eval-mode float32 model; ``save_tiny(kind, path)`` writes a
Hugging Face folder (config, safetensors, a tiny word-level tokenizer with a chat template) that
every CLI verb can load like a real target; ``random_head(model)`` a frozen random EAGLE-3 head for
it, with a random draft vocabulary; ``assert_rounds_are_the_ttt_unroll`` checks recorded drafts
against the training unroll.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(kind: str = "llama", vocab: int = VOCAB, layers: int = 4):
    from transformers import DeepseekV3Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=1024, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "deepseek_v3":
        return DeepseekV3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=16, max_position_embeddings=1024, num_nextn_predict_layers=0,
                                rope_interleave=True, tie_word_embeddings=False,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raise ValueError(kind)


def make_tiny(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab, layers), dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        model.lm_head.weight.mul_(20.0)
    return model.eval().requires_grad_(False)


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer: ids 0-4 specials, the rest words ``w5``..``w{vocab-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
    words = {t: i for i, t in enumerate(specials)}
    words.update({f"w{i}": i for i in range(len(specials), vocab - 3)})
    words.update({"system": vocab - 3, "user": vocab - 2, "assistant": vocab - 1})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|im_end|>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(kind: str, path: str | Path, seed: int = 0, vocab: int = VOCAB, layers: int = 4) -> Path:
    path = Path(path)
    make_tiny(kind, seed, vocab, layers).save_pretrained(path)
    tiny_tokenizer(vocab).save_pretrained(path)
    return path


def random_head(model, draft_vocab: int = 64, seed: int = 0, aux_layer_ids=(0, 1, 2), **options):
    """A frozen, randomly initialised EAGLE-3 head for ``model`` (``options``: ``Eagle3Config.for_target``'s,
    ``attention`` included) whose draft vocabulary is a random subset of the target's."""
    from outrider.heads.eagle3 import Eagle3Config, Eagle3Head

    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux_layer_ids, **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    head.set_vocab(*random_vocab(model.config.vocab_size, draft_vocab))
    return head.eval().requires_grad_(False)


def random_vocab(vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocabulary that is a random subset of ``vocab`` ids (torch's global RNG)."""
    kept = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab), t2d


def assert_rounds_are_the_ttt_unroll(model, head, rounds, k: int) -> None:
    """Every round's k drafts (``rounds``: (history when drafted, draft target ids)) are what the
    training-time test predicts at the round's position: drafting and training are one computation."""
    from outrider.models import AuxCapture
    from outrider.train.loop.ttt import ttt_loss

    assert len(rounds) > 3
    dv = head.config.draft_vocab_size
    draft_of = {int(t): d for d, t in enumerate((torch.arange(dv) + head.d2t).tolist())}
    for history, drafts in rounds:
        seq = torch.tensor([history + drafts])
        L = len(history)
        with AuxCapture(model, head.config.aux_layer_ids) as cap:
            model(seq)
            aux = cap.concat()
        teacher = torch.zeros(1, L + k, dv)  # one-hot at each draft: agreement = the unroll's argmax is the draft
        for j, token in enumerate(drafts):
            teacher[0, L - 1 + j, draft_of[token]] = 1.0
        with torch.no_grad():
            out = ttt_loss(head, model.get_input_embeddings(), aux, seq, torch.ones_like(seq), teacher, steps=k,
                           agree_map=True)
        assert out.agree[:, 0, L - 2].tolist() == [True] * k, (L, drafts)


def assert_compiled_greedy_is_plain(model, proposer, prompts, max_new: int, k: int = 4) -> None:
    """With the engine's step compiled (aot_eager), per-step and device rounds at batch 1 and 2 give
    plain greedy's tokens; dynamo's caches are reset first, so a caller may count compiled variants."""
    from outrider.decode.engine import SpecEngine

    refs = SpecEngine(model, None).generate(prompts, max_new).tokens
    torch._dynamo.reset()
    for rounds in (0, 8):
        engine = SpecEngine(model, proposer, k=k, compile="aot_eager", read_len="max", rounds=rounds)
        for batch in (1, 2):
            got = [t for i in range(0, len(prompts), batch) for t in engine.generate(prompts[i:i + batch],
                                                                                    max_new).tokens]
            assert got == refs, (rounds, batch)
