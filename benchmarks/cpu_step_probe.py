"""One decode step of the default model on the CPU: our slot cache against transformers' dynamic cache.

    python benchmarks/cpu_step_probe.py      # median ms of 40 steps over a 300-token context, twice
"""
import time, torch
from outrider.models import load_model
from outrider.kv_cache import CachedLM
from transformers import DynamicCache
model, tok = load_model("default")
torch.manual_seed(0)
ctx = torch.randint(100, 20000, (1, 300))
def ours(mask_none=False):
    lm = CachedLM(model, 1, 1024)
    lm.forward(ctx, logits_at=torch.tensor([299]))
    lm.commit(torch.ones(1, 300, dtype=torch.bool))
    ids = torch.tensor([[5]])
    ts = []
    for i in range(40):
        t = time.perf_counter(); lm.forward(ids); lm.commit(torch.ones(1,1,dtype=torch.bool), used=1); ts.append(time.perf_counter()-t)
    return sorted(ts)[len(ts)//2]*1e3
def hf():
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
        ids = torch.tensor([[5]])
        ts = []
        for i in range(40):
            t = time.perf_counter(); model(input_ids=ids, past_key_values=cache, use_cache=True, attention_mask=torch.ones(1, 301+i, dtype=torch.long)); ts.append(time.perf_counter()-t)
    return sorted(ts)[len(ts)//2]*1e3
for _ in range(2):
    print("ours ms", round(ours(), 2), "hf ms", round(hf(), 2), flush=True)
