"""Load a trained head, exported in each format, into the peers' own model classes (SpecForge's
``LlamaForCausalLMEagle3``, speculators' ``Eagle3DraftModel``) and compare their logits with ours
in float32, on the real target's aux states. Prints one line per check and a final JSON line.

    python benchmarks/peer_check.py HEAD_DIR [--target default] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from outrider.interop.checkpoint import load_head
from outrider.interop.formats.export import export
from outrider.models import AuxCapture, load_model, resolve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch._dynamo.config.disable = True  # SpecForge's RMSNorm is torch.compile'd; eager is enough here
    target, tok = load_model(a.target, device="cpu", dtype="float32")
    head, cfg = load_head(a.head, target_config=target.config)
    head.eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    input_ids = torch.tensor([ids])  # [1, n]
    with AuxCapture(target, sorted(cfg.aux_layer_ids)) as cap, torch.no_grad():
        target(input_ids)
        aux = cap.concat()  # [1, n, 3H], ids ascending as the engines capture them
        ours_aux = torch.cat([cap.states[j] for j in cfg.aux_layer_ids], dim=-1)
        emb = target.get_input_embeddings()(input_ids)
        ours, _ = head(emb, head.fuse(ours_aux), torch.arange(input_ids.shape[1])[None])
    results = {}
    out = Path(a.out or tempfile.mkdtemp())
    from specforge.modeling.draft import llama3_eagle
    from transformers import LlamaConfig

    for fmt in ("sglang", "vllm"):
        export(a.head, fmt, out / fmt, target=str(resolve(a.target)), dtype="float32", include_embeddings=True)
        peer = llama3_eagle.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(out / fmt)).float().eval()
        res = peer.load_state_dict(load_file(out / fmt / "model.safetensors"), strict=False)
        with torch.no_grad():
            theirs = peer.lm_head(peer(hidden_states=aux, inputs_embeds=peer.embed_input_ids(input_ids)))
        diff = (theirs - ours).abs().max().item()
        results[f"specforge_{fmt}"] = {"missing": res.missing_keys, "unexpected": res.unexpected_keys, "max_abs_diff": diff}
        print(f"SpecForge LlamaForCausalLMEagle3 <- {fmt}: missing {res.missing_keys} unexpected "
              f"{res.unexpected_keys} max |logit diff| {diff:.2e}", flush=True)
    from speculators.models import eagle3 as core

    path = out / "speculators"
    export(a.head, "speculators", path, target=str(resolve(a.target)), dtype="float32", include_embeddings=True)
    config = core.Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = core.Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    written, theirs_keys = set(load_file(path / "model.safetensors")), set(peer.state_dict())
    unexpected = sorted(written - theirs_keys)
    missing = sorted(theirs_keys - written - set(peer._keys_to_ignore_on_load_missing))
    captured = []
    peer.lm_head.register_forward_hook(lambda module, args, o: captured.append(o))
    n = input_ids.shape[1]
    with torch.no_grad():
        peer(hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros(1, n, dtype=torch.long),
             position_ids=torch.arange(n)[None], ttt_steps=1)
    diff = (captured[0] - ours).abs().max().item()
    results["speculators"] = {"missing": missing, "unexpected": unexpected, "max_abs_diff": diff}
    print(f"speculators Eagle3DraftModel <- speculators: missing {missing} unexpected {unexpected} "
          f"max |logit diff| {diff:.2e}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
