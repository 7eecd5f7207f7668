"""Drafts loaded by their method: every registry entry names a loader, one function builds the proposer."""

from __future__ import annotations

import pytest
from test_export import make_head
from tiny import make_tiny, save_tiny

from outrider.decode.proposers import PROPOSERS
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.proposers.ngram import NgramProposer
from outrider.errors import UserError
from outrider.interop.drafts import DRAFTS, build_proposer, folder_kind
from outrider.interop.formats.export import save_head
from outrider.trees import TreeBudget


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    target_dir = save_tiny("llama", root / "target", seed=0, layers=8)
    save_head(make_head(target_dir), root / "head", target=str(target_dir))
    return make_tiny("llama", seed=0, layers=8), target_dir, root / "head"


def test_every_method_names_a_loader():
    assert {m.needs for m in PROPOSERS.values()} - {None} <= set(DRAFTS)
    assert [name for name, m in PROPOSERS.items() if m.trees] == ["eagle3"]


def test_build_proposer_loads_by_the_method(world):
    model, target_dir, head = world
    assert build_proposer("ar", PROPOSERS["ar"], model) is None
    assert isinstance(build_proposer("ngram", PROPOSERS["ngram"], model), NgramProposer)
    eagle = build_proposer("eagle3", PROPOSERS["eagle3"], model, draft=str(head), tree=TreeBudget(2, 2, 4))
    assert isinstance(eagle, Eagle3Proposer) and eagle.tree == TreeBudget(2, 2, 4)
    assert folder_kind(str(head)) == "head" and folder_kind(str(target_dir)) == "model"


@pytest.mark.parametrize("method, draft, tree, says", [
    ("eagle3", None, None, "needs --draft"),
    ("ngram", None, TreeBudget(2, 2, 4), "drafts chains"),
    ("parallel", "head", None, "needs a parallel-drafting head"),
])
def test_refusals_are_one_line(world, method, draft, tree, says):
    model, _, head = world
    with pytest.raises(UserError, match=says):
        build_proposer(method, PROPOSERS[method], model, draft=str(head) if draft else None, tree=tree)
