"""One draft per round, a chain or a tree, with its ancestry computed once when it is made.

Contract: a ``Draft`` is N drafted nodes per row: token ids ``[batch, N]``, a parent index ``[N]``
(one shape for every row) or ``[batch, N]`` (EAGLE-2 chooses per row; -1 is the root, the last
committed token; parents precede children), the real nodes per row (``num``: the first num[b]; the
rest is padding, never accepted) and ``q`` (the distribution each node was drawn from) or None
(point masses). A chain of k is the tree whose parents are i - 1 (``Draft.chain``: its structure
is built once per (k, device) from ``arange`` and ``tril``, no loop). On construction the draft
holds, on the tokens' device, its ancestry table ``ancestors`` ``[rows, N, N]`` and ``depths``
``[rows, N]`` (rows: 1 for a shared shape, else batch; ``ops.tree``: no loop over nodes, no host
value): the target's mask and positions (``verify_mask``, ``offsets``) and the verification
(``decode.verify``) read them, so a round builds its ancestry once. ``levels`` (the greatest depth)
and ``width`` (the most children of one node) are host integers fixed by the tree's shape.

Not done here: drafting (``proposers``), verifying (``verify``), running the target (``runner``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from outrider.ops.tree import ancestors, mask_of


@functools.cache
def _chain_structure(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain of k as a tree: (parents [k], ancestors [1, k, k], depths [1, k]); shared: never written."""
    parents = torch.arange(-1, k - 1, device=device)
    anc = torch.ones(1, k, k, dtype=torch.bool, device=device).tril()
    return parents, anc, torch.arange(1, k + 1, device=device)[None]


@dataclass
class Draft:
    """A draft tree per row (see the module's contract); ``Draft.chain`` for chains."""

    tokens: torch.Tensor  # [batch, N] long; nodes >= num[b] are padding
    parents: torch.Tensor  # [N] or [batch, N] long: each node's parent, -1 the root
    num: torch.Tensor  # [batch] long, real nodes per row
    q: torch.Tensor | None = None  # [batch, N, vocab] draft probabilities, or None (point masses)
    depth: int | None = None  # the greatest depth of a node (None: N, as a chain's)
    width: int | None = None  # the most children of one node, the root's included (None: from the parents)
    ancestors: torch.Tensor | None = None  # [rows, N, N] bool, (i, j): j is i or an ancestor of i (None: computed)
    depths: torch.Tensor | None = None  # [rows, N] long, 1 for the root's children (None: computed)
    linear: bool = False  # a chain, made by ``Draft.chain``: the target verifies it as its plain causal step

    def __post_init__(self) -> None:
        dev = self.tokens.device
        self.parents = self.parents.to(dev)
        if self.ancestors is None:
            self.ancestors = ancestors(self.parents, self.depth)  # [rows, N, N], once per draft
        if self.depths is None:
            self.depths = self.ancestors.sum(-1)  # [rows, N]

    @classmethod
    def chain(cls, tokens: torch.Tensor, num: torch.Tensor, q: torch.Tensor | None = None) -> "Draft":
        """tokens: [batch, k]; num: [batch]; q: [batch, k, vocab] or None."""
        parents, anc, depths = _chain_structure(tokens.shape[1], tokens.device)
        return cls(tokens, parents, num, q, width=1, ancestors=anc, depths=depths, linear=True)

    def is_chain(self) -> bool:
        return self.linear

    @property
    def levels(self) -> int:
        """The greatest depth of a node: the most tokens a round can accept."""
        return self.tokens.shape[1] if self.depth is None else self.depth

    @property
    def siblings(self) -> int:
        """The most children of one node (a bound the sampled verification loops over)."""
        if self.width is not None:
            return self.width
        N = self.tokens.shape[1]
        if N == 0 or self.parents.dim() != 1 or self.parents.device.type != "cpu":
            return max(N, 1)  # counting per row would read the device: every node a sibling bounds it
        return int(torch.bincount(self.parents + 1).max())

    def rows_parents(self) -> torch.Tensor:
        """The parent index as ``[batch, N]``."""
        return self.parents.expand(self.tokens.shape[0], -1) if self.parents.dim() == 1 else self.parents

    def offsets(self) -> torch.Tensor:
        """[rows, 1 + N] position of the root and each node past the root's: 0, then the depths."""
        return torch.nn.functional.pad(self.depths, (1, 0))

    def verify_mask(self) -> torch.Tensor:
        """[rows, 1 + N, 1 + N] bool: which of root + nodes each of root + nodes sees in the target."""
        return mask_of(self.ancestors)

    def drafted(self) -> torch.Tensor:
        """[batch] the depth of each row's deepest real node (a chain's: num), counted as drafted."""
        N = self.tokens.shape[1]
        real = torch.arange(N, device=self.tokens.device)[None, :] < self.num[:, None]  # [batch, N]
        return torch.where(real, self.depths, 0).amax(1) if N else self.num
