"""The chunked, threaded, coarse-to-fine block search against the plain search over all 19 ratios."""

from __future__ import annotations

import numpy as np
import pytest

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.weight_only import blockwise


def _plain_errors(weight, bits, block_size, symmetric, ratios):
    """Per ratio: the scale, zero point, integers and per-block squared error, as first written."""
    dtype = blockwise._quantized_type(bits, symmetric)
    qmin, qmax = qdq_params.INTEGER_RANGES[dtype]
    blocks = blockwise._blocks(weight.astype(np.float32), block_size)
    rows = []
    for ratio in ratios:
        scale, zero_point = blockwise._candidate(blocks, ratio, symmetric, qmin, qmax, weight.dtype)
        q = blockwise._quantize_with(blocks, scale, zero_point, qmin, qmax)
        error = (((q - zero_point[:, None, :]) * scale[:, None, :] - blocks) ** 2).sum(axis=1)
        rows.append((scale, zero_point, q, error))
    return blocks, rows


def _container(q, weight, symmetric):
    data = q.reshape(-1, weight.shape[1])[: weight.shape[0]].astype(np.int16)
    return data.astype(np.int8 if symmetric else np.uint8)


def _weights():
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal((200, 96)) * np.logspace(-3, 2, 96)).astype(np.float32)
    spread[:, :5] = 0  # all-zero blocks: scale 0
    spread[3, 7] = 1e30  # overflowing squared error
    return [spread, spread.astype(np.float16), np.abs(spread[:64]) + 1, rng.standard_normal((48, 33)).astype(np.float32),
            (rng.standard_t(3, (256, 64)) * 0.02).astype(np.float32)]


def _sqnr(weight, quantized) -> float:
    reference = weight.astype(np.float64)
    noise = ((blockwise.dequantize_blockwise(quantized).astype(np.float64) - reference) ** 2).sum()
    return float(10 * np.log10((reference ** 2).sum() / noise))


PARAMETERS = pytest.mark.parametrize("bits,block_size", [(4, 32), (8, 16), (4, 64)])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the 1e30 weight overflows the squared error
@pytest.mark.parametrize("symmetric", [True, False])
@PARAMETERS
def test_absmax_rounding_equals_the_plain_quantization_bit_for_bit(monkeypatch, symmetric, bits, block_size):
    monkeypatch.setattr(blockwise, "_CHUNK_ELEMENTS", 1000)  # many chunks, on several threads
    for weight in _weights():
        got = blockwise.quantize_blockwise(weight, bits=bits, block_size=block_size, symmetric=symmetric,
                                           scale_search=False)
        _, [(scale, zero_point, q, _)] = _plain_errors(weight, bits, block_size, symmetric, blockwise._SEARCH_RATIOS[:1])
        np.testing.assert_array_equal(got.data, _container(q, weight, symmetric))
        assert got.scale.dtype == weight.dtype
        np.testing.assert_array_equal(got.scale, scale.astype(weight.dtype))
        assert (got.zero_point is None) == symmetric
        if not symmetric:
            np.testing.assert_array_equal(got.zero_point, zero_point.astype(np.uint8))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("symmetric", [True, False])
@PARAMETERS
def test_search_picks_a_candidate_at_least_as_good_as_every_coarse_ratio(monkeypatch, symmetric, bits, block_size):
    """Each block gets one of the 19 candidate scales, its integers are ONNX QuantizeLinear's at that
    scale bit for bit, its error is no worse than at any ratio of the coarse pass, the whole weight's
    SQNR is within 0.02 dB of the exhaustive search, and the chunking changes nothing."""
    for weight in _weights():
        kwargs = {"bits": bits, "block_size": block_size, "symmetric": symmetric}
        got = blockwise.quantize_blockwise(weight, **kwargs)
        monkeypatch.setattr(blockwise, "_CHUNK_ELEMENTS", 1000)
        chunked = blockwise.quantize_blockwise(weight, **kwargs)
        monkeypatch.undo()
        np.testing.assert_array_equal(chunked.data, got.data)
        np.testing.assert_array_equal(chunked.scale, got.scale)
        _, rows = _plain_errors(weight, bits, block_size, symmetric, blockwise._SEARCH_RATIOS)
        scales = np.stack([row[0].astype(weight.dtype) for row in rows])
        chosen = np.argmax(scales == got.scale[None], axis=0)
        assert np.all(np.take_along_axis(scales, chosen[None], 0)[0] == got.scale)  # one of the candidates
        q = np.take_along_axis(np.stack([row[2] for row in rows]), chosen[None, :, None, :], 0)[0]
        np.testing.assert_array_equal(got.data, _container(q, weight, symmetric))
        errors = np.stack([row[3] for row in rows]).astype(np.float64)
        mine = np.take_along_axis(errors, chosen[None], 0)[0]
        coarse = errors[::blockwise._COARSE_STEP].min(axis=0)
        finite = np.isfinite(mine) & np.isfinite(coarse)
        assert np.all(mine[finite] <= coarse[finite] * (1 + 1e-5) + 1e-30)
        exhaustive = np.argmin(errors, axis=0)
        best_scale = np.take_along_axis(scales, exhaustive[None], 0)[0]
        best_zero_point = None if symmetric else np.take_along_axis(
            np.stack([row[1] for row in rows]), exhaustive[None], 0)[0].astype(np.uint8)
        best_q = np.take_along_axis(np.stack([row[2] for row in rows]), exhaustive[None, :, None, :], 0)[0]
        reference = blockwise.BlockQuantized(_container(best_q, weight, symmetric), best_scale, best_zero_point,
                                             block_size, got.dtype)
        if np.isfinite(weight.astype(np.float64) ** 2).all() and np.abs(weight).max() < 1e20:
            assert _sqnr(weight, got) >= _sqnr(weight, reference) - 0.02
