"""The chunked, threaded, in-place block search equals the plain search it replaced, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.weight_only import blockwise


def _plain_search(weight, bits, block_size, symmetric, scale_search):
    """The search as first written: every ratio over the whole weight, the best integers kept as it goes."""
    scale_dtype = weight.dtype
    dtype = blockwise._quantized_type(bits, symmetric)
    qmin, qmax = qdq_params.INTEGER_RANGES[dtype]
    blocks = blockwise._blocks(weight.astype(np.float32), block_size)
    best = None
    for ratio in (blockwise._SEARCH_RATIOS if scale_search else blockwise._SEARCH_RATIOS[:1]):
        scale, zero_point = blockwise._candidate(blocks, ratio, symmetric, qmin, qmax, scale_dtype)
        q = blockwise._quantize_with(blocks, scale, zero_point, qmin, qmax)
        error = (((q - zero_point[:, None, :]) * scale[:, None, :] - blocks) ** 2).sum(axis=1)
        if best is None:
            best = [scale, zero_point, q, error]
            continue
        better = error < best[3]
        best[0] = np.where(better, scale, best[0])
        best[1] = np.where(better, zero_point, best[1])
        best[2] = np.where(better[:, None, :], q, best[2])
        best[3] = np.minimum(error, best[3])
    scale, zero_point, q, _ = best
    data = q.reshape(-1, weight.shape[1])[: weight.shape[0]].astype(np.int16).astype(np.uint8 if qmin == 0 else np.int8)
    return data, scale.astype(scale_dtype), None if symmetric else zero_point.astype(np.uint8)


def _weights():
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal((200, 96)) * np.logspace(-3, 2, 96)).astype(np.float32)
    spread[:, :5] = 0  # all-zero blocks: scale 0
    spread[3, 7] = 1e30  # overflowing squared error
    return [spread, spread.astype(np.float16), np.abs(spread[:64]) + 1, rng.standard_normal((48, 33)).astype(np.float32)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the 1e30 weight overflows the squared error
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_search", [True, False])
@pytest.mark.parametrize("bits,block_size", [(4, 32), (8, 16), (4, 64)])
def test_quantize_blockwise_equals_the_plain_search(monkeypatch, symmetric, scale_search, bits, block_size):
    monkeypatch.setattr(blockwise, "_CHUNK_ELEMENTS", 1000)  # many chunks, on several threads
    for weight in _weights():
        got = blockwise.quantize_blockwise(weight, bits=bits, block_size=block_size, symmetric=symmetric,
                                           scale_search=scale_search)
        data, scale, zero_point = _plain_search(weight, bits, block_size, symmetric, scale_search)
        np.testing.assert_array_equal(got.data, data)
        assert got.data.dtype == data.dtype and got.scale.dtype == scale.dtype
        np.testing.assert_array_equal(got.scale, scale)
        if zero_point is None:
            assert got.zero_point is None
        else:
            np.testing.assert_array_equal(got.zero_point, zero_point)
