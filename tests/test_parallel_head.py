"""P-EAGLE heads: config, the placeholder inputs, and the training-time test with placeholders."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_config

from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.train.loop.ttt import ttt_loss

VD = 40


def _head(parallel: bool = True, seed: int = 0) -> Eagle3Head:
    options = {"parallel_drafting": True, "mask_token_id": 5} if parallel else {}
    cfg = Eagle3Config.for_target(tiny_config("llama", layers=4), VD, aux_layer_ids=(1, 2, 3), **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "mask_hidden":
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return head


def test_config_round_trip_and_checks():
    head = _head()
    d = head.config.to_dict()
    assert d["parallel_drafting"] is True and d["mask_token_id"] == 5
    assert Eagle3Config.from_dict(d) == head.config
    assert tuple(head.mask_hidden.shape) == (1, 3 * 64)
    plain = _head(parallel=False)
    assert "parallel_drafting" not in plain.config.to_dict() and plain.mask_hidden is None
    assert "mask_hidden" not in plain.state_dict()
    with pytest.raises(UserError, match="mask_token_id"):
        Eagle3Config.from_dict({**d, "mask_token_id": -1})
    with pytest.raises(UserError, match="true or false"):
        Eagle3Config.from_dict({**d, "parallel_drafting": "yes"})


def _batch(B=2, S=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 96, (B, S), generator=g)
    aux = torch.randn(B, S, 3 * 64, generator=g)
    teacher = 3 * torch.randn(B, S, VD, generator=g)
    embed = torch.nn.Embedding(96, 64).requires_grad_(False)
    return embed, aux, ids, torch.ones(B, S, dtype=torch.long), teacher


def test_placeholder_steps_see_no_later_token_and_train_mask_hidden():
    head = _head()
    embed, aux, ids, mask, teacher = _batch()
    out = ttt_loss(head, embed, aux, ids, mask, teacher, steps=3, agree_map=True)
    out.loss.backward()
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0
    # steps after the first read placeholders: changing the tokens after t + 1 changes nothing they
    # compute at t (an EAGLE-3 head's step 1 reads x_{t+2} and changes)
    t = 4
    ids2 = ids.clone()
    ids2[:, t + 2:] = (ids2[:, t + 2:] + 7) % 90 + 6
    a = ttt_loss(head, embed, aux, ids, mask, teacher, steps=3, agree_map=True).agree
    b = ttt_loss(head, embed, aux, ids2, mask, teacher, steps=3, agree_map=True).agree
    assert torch.equal(a[1:, :, : t + 1], b[1:, :, : t + 1])
    plain = _head(parallel=False)
    pa = ttt_loss(plain, embed, aux, ids, mask, teacher, steps=3, agree_map=True).per_step_loss
    pb = ttt_loss(plain, embed, aux, ids2, mask, teacher, steps=3, agree_map=True).per_step_loss
    assert not torch.equal(pa[1:], pb[1:])


def test_a_few_steps_of_training_lower_the_placeholder_loss():
    head = _head()
    embed, aux, ids, mask, teacher = _batch(S=16)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        out = ttt_loss(head, embed, aux, ids, mask, teacher, steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.per_step_loss.detach()
    assert out.per_step_loss[1:].sum() < 0.8 * first[1:].sum()
