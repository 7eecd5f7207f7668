"""Targets and heads whose walked tau is known, for checks against real servers.

The target (Llama, or DeepSeek-V3 with MLA and MoE): every decoder layer adds nothing (attention
``o_proj`` and every MLP's down projection zero) except layer ``NOISE_LAYER``, whose MLP adds a
large state in the upper half of the hidden width only. Embeddings live in the lower half, so the
target's greedy next token is ``P(x)`` for a fixed permutation ``P`` of the word ids (``lm_head``
rows are embeddings) and the noise never changes it. Its chat template renders the prompt's words
alone, so each reply continues its prompt's last word.

The head adds nothing in its layer either; ``fc`` copies the first aux state's lower half and
folds its upper half into it, and ``lm_head`` predicts ``P(P(x))`` from the state of ``x``. So with
the aux ids it was built for (the first one at or below ``NOISE_LAYER``: no noise) the first draft
is always right and the later ones almost never: walked tau about 2. A server that hands the head
another layer (ids shifted by one) feeds it the noise, and one that ignores ``d2t`` (the draft
vocabulary is the words only, offset by the specials) maps every draft to another token: both
accept almost nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny import VOCAB, tiny_tokenizer

LAYERS = 8
NOISE_LAYER = 2
AUX = (2, 4, 5)
SPECIALS = 5  # ids 0-4 (tiny_tokenizer); the words are 5..VOCAB-1
PROMPTS = ["w10 w11 w12", "w40 w41", "w70 w71 w72 w73", "w20 w33"]
# the prompt's words only: each reply starts from its prompt's last word, so the replies differ
CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"


def permutation() -> list[int]:
    """One cycle over the words; the specials stay put."""
    ids = list(range(SPECIALS, VOCAB))
    perm = list(range(VOCAB))
    for j, i in enumerate(ids):
        perm[i] = ids[(j + 1) % len(ids)]
    return perm


def target_config(kind: str):
    """Shapes vLLM's CPU kernels take: head_dim 64; MLA with a 512 + 64 latent (CPU_MLA's only width)."""
    from transformers import DeepseekV3Config, LlamaConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                  num_attention_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)
    if kind == "llama":
        return LlamaConfig(**common, num_key_value_heads=2, head_dim=64)
    return DeepseekV3Config(**common, num_key_value_heads=2, moe_intermediate_size=64, n_shared_experts=1,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64,
                            qk_nope_head_dim=64, v_head_dim=64, num_nextn_predict_layers=0, rope_interleave=True)


def _zero_down(mlp) -> None:
    """Every down projection of a dense MLP or an MoE block (fused experts and the shared expert)."""
    for name, p in mlp.named_parameters():
        if "down" in name:
            p.data.zero_()


def _noise_mlp(layer) -> torch.nn.Linear:
    mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
    return mlp.down_proj


def build_target(kind: str, out: Path, seed: int = 0) -> Path:
    """Save the permuted target (``kind``: llama or deepseek_v3) as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(kind), dtype=torch.float32).eval()
    H = model.config.hidden_size
    perm = permutation()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # [vocab, H]
        emb.normal_()
        emb[:, H // 2:] = 0.0  # the lower half only: the noise never reaches the logits
        emb[0] = 0.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            _zero_down(layer.mlp)
        noise = _noise_mlp(model.model.layers[NOISE_LAYER])  # [H, intermediate]
        noise.weight.normal_(std=2.0)
        noise.weight[: H // 2] = 0.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for x in range(VOCAB):
            model.lm_head.weight[perm[x]] = 50 * emb[x]
    model.save_pretrained(out)
    tok = tiny_tokenizer()
    tok.chat_template = CONTENT_ONLY
    tok.save_pretrained(out)
    return _as_deepseek_configs_say(kind, out)


def build_head(target: Path, attention: str = "gqa", parallel: bool = False):
    """The head (see the module docstring) for the target saved in ``target``."""
    from transformers import AutoModelForCausalLM

    from outrider.heads.eagle3 import Eagle3Config, Eagle3Head

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    H = model.config.hidden_size
    options = {"parallel_drafting": True, "mask_token_id": 0} if parallel else {}
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=VOCAB - SPECIALS, aux_layer_ids=AUX,
                                  attention=attention, **options)
    torch.manual_seed(1)
    head = Eagle3Head(cfg)
    perm = permutation()
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()  # [H, 3 H_t]
        head.fc.weight[: H // 2, : H // 2] = torch.eye(H // 2)
        head.fc.weight[: H // 2, H // 2: H] = torch.randn(H // 2, H // 2)  # the upper half folded in
        head.norm.weight.fill_(1.0)
        head.lm_head.weight.zero_()  # [draft_vocab, H]: draft index d is target id d + SPECIALS
        emb = model.model.embed_tokens.weight
        for x in range(SPECIALS, VOCAB):
            head.lm_head.weight[perm[perm[x]] - SPECIALS] = 50 * emb[x]
        if head.mask_hidden is not None:
            head.mask_hidden.zero_()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[SPECIALS:] = True
    head.set_vocab(torch.full((VOCAB - SPECIALS,), SPECIALS, dtype=torch.long), t2d)
    return head.eval().requires_grad_(False)


def build_dflash(target: Path, block_size: int = 4, kv_heads: int | None = None):
    """A DFlash drafter of known acceptance for the target in ``target``: its one layer's mask queries
    are zero (the mask token 0 embeds to zero), so they attend evenly to every key, and every
    value is zero but the block's first token's (``v_proj`` and ``o_proj`` the identity); after the
    final norm ``lm_head`` predicts ``P(x_p)`` at every mask. The first draft is always right, the
    later ones almost never: walked tau about 2. ``fc`` reads only the upper half of the first aux
    state, zero at the ids it was built for; a server that hands it another layer (the noise) fills
    the context values and the drafts go wrong. ``kv_heads`` (the drafter's own, else the target's):
    with fewer key/value heads than the identity needs, the values keep the first ``kv * head_dim``
    dims of the token's embedding and ``o_proj`` passes the first head's back."""
    from transformers import AutoModelForCausalLM

    from outrider.heads.dflash import DFlashConfig, DFlashDrafter

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    H = model.config.hidden_size
    cfg = DFlashConfig.for_target(model.config, VOCAB - SPECIALS, mask_token_id=0, block_size=block_size,
                                  num_layers=1, aux_layer_ids=AUX, num_kv_heads=kv_heads)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg)
    perm = permutation()
    attn = drafter.layers[0].self_attn
    with torch.no_grad():
        drafter.fc.weight.zero_()  # [H, 3 H_t]
        drafter.fc.weight[:, H // 2: H] = torch.randn(H, H // 2)
        width = cfg.num_key_value_heads * cfg.head_dim  # [width, H]: the values keep the first dims
        attn.v_proj.weight.copy_(torch.eye(H)[:width])
        attn.o_proj.weight.zero_()  # [H, heads * head_dim]
        attn.o_proj.weight[:, :width].copy_(torch.eye(H)[:, :width])
        drafter.layers[0].mlp.down_proj.weight.zero_()
        drafter.lm_head.weight.zero_()
        emb = model.model.embed_tokens.weight
        for x in range(SPECIALS, VOCAB):
            drafter.lm_head.weight[perm[x] - SPECIALS] = 50 * emb[x]
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[SPECIALS:] = True
    drafter.set_vocab(torch.full((VOCAB - SPECIALS,), SPECIALS, dtype=torch.long), t2d)
    return drafter.eval().requires_grad_(False)


def save_random(kind: str, out: Path, seed: int = 0) -> Path:
    """A randomly initialised target of the same shapes (the plain tiny chat template): varied states
    for capture checks."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(kind), dtype=torch.float32).eval()
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return _as_deepseek_configs_say(kind, out)


def _as_deepseek_configs_say(kind: str, out: Path) -> Path:
    """DeepSeek-V3's published configs name the gate (vLLM builds the gate's bias from it)."""
    if kind == "deepseek_v3":
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
