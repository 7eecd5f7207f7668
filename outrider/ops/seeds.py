"""Seeds of independent random streams derived from one seed.

Contract: ``derived_seed(seed, index, bits)`` is the seed of stream ``index`` (an int or a string)
of ``seed``: a hash below ``2**bits``, so that neighbouring seeds or indices share no streams.

Not done here: drawing (``decode.sampling``, ``torch.Generator``).
"""

from __future__ import annotations

import hashlib


def derived_seed(seed: int, index: int | str, bits: int = 40) -> int:
    """The seed of stream ``index`` of ``seed``, in ``[0, 2**bits)`` (hash-mixed, not ``seed + index``)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << bits)
