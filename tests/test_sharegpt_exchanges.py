"""``sharegpt.deeper_exchanges``: which deeper exchanges of the training split are regenerated."""

from __future__ import annotations

from types import SimpleNamespace

from outrider.sharegpt import deeper_exchanges, heldout


def _ids(want_heldout: bool, n: int) -> list[str]:
    ids = (f"c{i}" for i in range(10_000))
    return [c for c in ids if heldout(c) == want_heldout][:n]


def _turns(whos: str, opening: str = "") -> list[dict]:
    return [{"from": {"h": "human", "g": "gpt"}[w], "value": f"turn {i}" if i or not opening else opening}
            for i, w in enumerate(whos)]


def test_deeper_exchanges_take_the_first_2n_alternating_turns_of_the_training_split():
    a, b, c, d = _ids(False, 4)
    (held,) = _ids(True, 1)
    sharegpt = SimpleNamespace(conversations=[
        {"id": a, "conversations": _turns("hghghghghg")},   # 5 exchanges: #3, #4 and #5
        {"id": b, "conversations": _turns("hghghhg")},      # 3rd exchange broken (two human turns)
        {"id": c, "conversations": _turns("hghghgh")},      # 3 exchanges and a question: #3 only
        {"id": held, "conversations": _turns("hghghghg", "a held-out prompt")},  # held out: never
        {"id": d, "conversations": _turns("hghghghg", "A held-out  prompt")},  # opens with it: never
    ])
    out = deeper_exchanges(sharegpt)
    assert [r["id"] for r in out] == [f"{a}#3", f"{c}#3", f"{a}#4", f"{a}#5"]
    for r in out:
        n = int(r["id"].split("#")[1])
        assert [t["from"] for t in r["conversations"]] == ["human", "gpt"] * n
        assert r["conversations"][-1]["value"] == f"turn {2 * n - 1}"
