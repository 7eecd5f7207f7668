"""The lossless verdict: exact in float32, never NO for a correct engine in bf16, and NO for a
deliberately broken acceptance rule in bf16 as well (the real default model, whose confident
predictions give a wrong token a margin far beyond rounding)."""

from __future__ import annotations

import pytest
import torch

import outrider.decode.verify as verify_module
from outrider.bench.local import bench, verdict_cell
from outrider.bench.verdict import Verdict, first_difference, judge, noise_bound
from outrider.decode.verify import VerifyResult, verify_greedy

PROMPTS = "Name three primary colors.\nWrite a haiku about the sea.\nWhat is 12 times 7?\n"


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS)
    return str(path)


@pytest.fixture(scope="module")
def default_bf16():
    from outrider import assets
    from outrider.models import load_model

    if not (assets.default_model_dir() / "config.json").exists():
        pytest.skip("default model not pulled (run `outrider pull`)")
    return load_model("default", device="cpu", dtype="bfloat16")


def _chain_path(n: torch.Tensor, k: int) -> torch.Tensor:
    """A chain's accepted nodes by depth, [batch, k]: 0..n-1, then -1."""
    ar = torch.arange(k)[None, :]
    return torch.where(ar < n[:, None], ar, -1)


def off_by_one(draft, target_logits):
    """Accepts one drafted token more than matched the target's argmax."""
    res = verify_greedy(draft, target_logits)
    n = torch.minimum(res.num_accepted + 1, draft.num)
    tokens = res.tokens.clone()
    rows = torch.arange(draft.tokens.shape[0])
    grew = n > res.num_accepted
    tokens[rows[grew], res.num_accepted[grew]] = draft.tokens[rows[grew], res.num_accepted[grew]]
    return VerifyResult(n, tokens, _chain_path(n, draft.tokens.shape[1]))


def wrong_bonus(draft, target_logits):
    """Emits, after the accepted drafts, the argmax one position too early (the classic shift)."""
    res = verify_greedy(draft, target_logits)
    best = target_logits.argmax(-1)  # [batch, k+1]
    rows = torch.arange(draft.tokens.shape[0])
    tokens = res.tokens.clone()
    shifted = best[rows, (res.num_accepted - 1).clamp(min=0)]
    tokens[rows, res.num_accepted] = torch.where(res.num_accepted > 0, shifted, best[:, 0])
    return VerifyResult(res.num_accepted, tokens, res.path)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_verdict_texts_and_cells():
    assert Verdict("exact").text() == "exact" and Verdict("exact").lossless
    tie = Verdict("near-ties", 2, 0.0625, 0.25)
    assert tie.text() == "equal up to 2 near-ties (largest margin 0.0625, bound 0.25)" and tie.lossless
    no = Verdict("NO", 0, None, 0.25, {"prompt": 3, "token": 7, "margin": 4.5})
    assert no.text() == "NO: prompt 3, token 7, margin 4.5" and not no.lossless
    assert verdict_cell({"method": "eagle3", **tie.record()}) == "ties 2"
    assert verdict_cell({"method": "eagle3", **no.record()}) == "NO"
    assert verdict_cell({"method": "ar", "lossless": True}) == "reference"


def test_float32_is_exact(default_model, prompt_file):
    record = bench("default", "ngram", k=3, num_prompts=3, prompts=prompt_file, max_new_tokens=24,
                   loaded=default_model)
    assert record["verdict"] == "exact" and record["lossless"] is True
    assert record["near_ties"] == 0 and record["first_mismatch"] is None


def test_bf16_correct_engine_is_not_no(default_bf16, prompt_file):
    record = bench("default", "ngram", k=3, num_prompts=3, prompts=prompt_file, max_new_tokens=24,
                   loaded=default_bf16)
    assert record["dtype"] == "bfloat16"
    assert record["lossless"] is True and not record["verdict"].startswith("NO"), record["verdict"]


@pytest.mark.parametrize("rule", [off_by_one, wrong_bonus], ids=["off-by-one", "wrong-bonus"])
def test_bf16_broken_acceptance_is_no(default_bf16, prompt_file, monkeypatch, rule):
    monkeypatch.setattr(verify_module, "verify_greedy", rule)
    record = bench("default", "ngram", k=3, num_prompts=3, prompts=prompt_file, max_new_tokens=24,
                   loaded=default_bf16)
    assert record["verdict"].startswith("NO: prompt") and record["lossless"] is False, record["verdict"]
    assert record["first_mismatch"]["margin"] > record["near_tie_bound"]


def test_a_flipped_near_tie_is_a_near_tie_and_a_wrong_token_is_not(default_bf16):
    """judge on hand-made outputs: swapping the reference's token for its runner-up where the two
    are (nearly) tied is a near-tie; swapping it for a token far below is NO."""
    model, tok = default_bf16
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True,
                                     tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ids, closest = list(prompt), None
    with torch.no_grad():
        for j in range(24):  # plain greedy, remembering the closest top-2 gap
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            top = logits.topk(2)
            gap = float(top.values[0] - top.values[1])
            if closest is None or gap < closest[0]:
                closest = (gap, j, int(top.indices[1]))
            ids.append(int(top.indices[0]))
    reference = ids[len(prompt):]
    bound = noise_bound(model, [ids])
    gap, j, runner_up = closest
    flipped = reference[:j] + [runner_up]
    v = judge(model, [prompt], [reference], [[flipped]], k=3)
    margin = v.largest_margin if v.kind == "near-ties" else v.first_mismatch["margin"]
    assert abs(margin - gap) <= bound / 2 + 1e-6  # the paths' margins are the gap up to rounding
    assert v.kind == ("near-ties" if margin <= bound else "NO")
    if gap <= bound / 2:  # then every path sees a tie within the bound
        assert v.kind == "near-ties" and v.near_ties == 1
    far = reference[:5] + [int(tok.convert_tokens_to_ids("Ġzebra") or 0)]
    v = judge(model, [prompt], [reference], [[far]], k=3)
    assert v.kind == "NO" and v.first_mismatch["token"] == 5 and v.first_mismatch["margin"] > v.bound
