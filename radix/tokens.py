"""Token ids as the contiguous int32 arrays that the index hashes and compares."""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")  # little-endian int32: 4 bytes a token, same bytes on every machine
TokenInput = Union[Sequence[int], np.ndarray]


def as_token_array(tokens: TokenInput) -> np.ndarray:
    """Return `tokens` as a 1-D C-contiguous little-endian int32 array (no copy when it already is one).

    Token ids must lie in [0, 2**31); anything else is a ValueError, never a silent wrap-around.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1 and tokens.flags.c_contiguous:
            arr = tokens
        else:
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
            if tokens.dtype.kind not in "iu":
                raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
            if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
                raise ValueError("token ids must lie in [0, 2**31)")
            return np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    else:
        try:
            arr = np.array(tokens, dtype=TOKEN_DTYPE)
        except OverflowError as exc:
            raise ValueError("token ids must lie in [0, 2**31)") from exc
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError("token ids must lie in [0, 2**31)")
    return arr
