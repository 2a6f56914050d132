"""Block quantization of one weight ``W[K, N]`` along K: the numerics behind :func:`kenosis_rewrite.quantize_weights`.

Round-to-nearest, ties to even (``np.rint``, as ONNX QuantizeLinear), per block of ``block_size``
rows. Symmetric: int4 in [-8, 7] (int8 in [-128, 127]), zero point 0. Asymmetric: uint4 (uint8)
with a per-block zero point. With ``scale_search`` each block's scale is the clipping ratio of least
squared error among 19 between 1.0 and 0.55, searched coarse to fine: every third ratio first, then
the two either side of each block's best (11 of the 19 evaluated; on Gaussian and Student-t weights
the SQNR is within 0.01 dB of evaluating all 19, at 0.6x the time). The integers are those of ONNX
QuantizeLinear at the chosen scale (``rint(w / scale)``), bit for bit. Blocks are independent, so
they are searched in cache-sized chunks on every core; the result does not depend on the chunking.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.graph import qdq_params

__all__ = ["BlockQuantized", "quantize_blockwise", "dequantize_blockwise", "pack_matmul_nbits"]

_SEARCH_RATIOS = np.linspace(1.0, 0.55, 19)
_COARSE_STEP = 3  # the first pass of the search evaluates every third ratio...
_FINE_REACH = 2  # ...the second the two either side of each block's best
_CHUNK_ELEMENTS = 1 << 18  # floats per chunk of the scale search: its temporaries stay in a core's L2 cache


@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """A weight ``W[K, N]`` quantized in blocks of ``block_size`` rows (ONNX DQ axis 0)."""

    data: np.ndarray  # [K, N] integers (int8 container for 4-bit values)
    scale: np.ndarray  # [ceil(K / block_size), N], the weight's float type
    zero_point: np.ndarray | None  # same shape as scale, or None (symmetric)
    block_size: int
    dtype: ir.DataType  # INT4, UINT4, INT8 or UINT8

    @property
    def bits(self) -> int:
        return 4 if self.dtype in (ir.DataType.INT4, ir.DataType.UINT4) else 8


def _quantized_type(bits: int, symmetric: bool) -> ir.DataType:
    if bits == 4:
        return ir.DataType.INT4 if symmetric else ir.DataType.UINT4
    if bits == 8:
        return ir.DataType.INT8 if symmetric else ir.DataType.UINT8
    raise KenosisError(f"bits must be 4 or 8, got {bits!r}")


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """``weight[K, N]`` as float32 ``[n_blocks, block_size, N]``, the last block zero-padded.

    A float32 weight whose K is a multiple of ``block_size`` is only reshaped (no copy: a weight
    memory-mapped from an external file is read once, by the search itself).
    """
    k, n = weight.shape
    n_blocks = -(-k // block_size)
    if k == n_blocks * block_size and weight.dtype == np.float32 and weight.flags.c_contiguous:
        return weight.reshape(n_blocks, block_size, n)
    padded = np.zeros((n_blocks * block_size, n), np.float32)
    padded[:k] = weight
    return padded.reshape(n_blocks, block_size, n)


def _round_scale(scale: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Scales as stored in the model (``dtype``), back in float32 for the arithmetic."""
    return scale.astype(dtype).astype(np.float32)


def _quantize_with(blocks, scale, zero_point, qmin, qmax):
    safe = np.where(scale == 0, 1.0, scale)[:, None, :]
    q = np.clip(np.rint(blocks / safe) + zero_point[:, None, :], qmin, qmax)
    return np.where(scale[:, None, :] == 0, zero_point[:, None, :], q)


def _candidate(blocks, ratio, symmetric, qmin, qmax, scale_dtype):
    """Scale and zero point of every block for one clipping ratio."""
    if symmetric:
        amax = np.abs(blocks).max(axis=1) * ratio
        scale = _round_scale(amax / qmax, scale_dtype)
        return scale, np.zeros_like(scale)
    lo = np.minimum(blocks.min(axis=1), 0) * ratio
    hi = np.maximum(blocks.max(axis=1), 0) * ratio
    scale = _round_scale((hi - lo) / (qmax - qmin), scale_dtype)
    zero_point = np.clip(np.rint(qmin - lo / np.where(scale == 0, 1, scale)), qmin, qmax)
    return scale, zero_point


def quantize_blockwise(
    weight: np.ndarray, *, bits: int = 4, block_size: int = 32, symmetric: bool = True,
    scale_search: bool = True,
) -> BlockQuantized:
    """Round-to-nearest-even block quantization of ``weight[K, N]`` along K (axis 0).

    The scale type is the weight's type (float32 or float16). With ``scale_search`` every block
    gets the clipping ratio (of 19 between 1.0 and 0.55) with the smallest squared error.
    """
    if weight.ndim != 2:
        raise KenosisError(f"weights must be 2-D, got shape {weight.shape}")
    scale_dtype = weight.dtype if weight.dtype in (np.float16, np.float32) else np.float32
    dtype = _quantized_type(bits, symmetric)
    qmin, qmax = qdq_params.INTEGER_RANGES[dtype]
    blocks = _blocks(np.asarray(weight, np.float32), block_size)
    ratios = _SEARCH_RATIOS if scale_search else _SEARCH_RATIOS[:1]
    container = np.uint8 if qmin == 0 else np.int8
    # Blocks are independent: search them in cache-sized chunks, on every core (numpy releases the GIL).
    step = max(1, _CHUNK_ELEMENTS // (block_size * weight.shape[1]))
    chunks = [blocks[start:start + step] for start in range(0, blocks.shape[0], step)]
    search = functools.partial(_search, symmetric=symmetric, qmin=qmin, qmax=qmax, scale_dtype=scale_dtype,
                               ratios=ratios, container=container)
    if len(chunks) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
            parts = list(pool.map(search, chunks))
    else:
        parts = [search(chunks[0])]
    scale = np.concatenate([part[0] for part in parts])
    zero_point = np.concatenate([part[1] for part in parts])
    q = np.concatenate([part[2] for part in parts])
    return BlockQuantized(
        data=q.reshape(-1, weight.shape[1])[: weight.shape[0]],
        scale=scale.astype(scale_dtype),
        zero_point=None if symmetric else zero_point.astype(np.uint8),
        block_size=block_size,
        dtype=dtype,
    )


def _coarse_to_fine(evaluate, shape: tuple[int, ...], n_ratios: int) -> np.ndarray:
    """Per block, the index of the ratio of least ``evaluate(index)`` error (``index``: an int array of
    ``shape``): every :data:`_COARSE_STEP`-th ratio, then :data:`_FINE_REACH` either side of each
    block's best. Ties keep the ratio evaluated first; a NaN error never wins."""
    best_index = np.zeros(shape, np.intp)
    if n_ratios == 1:
        return best_index
    best_error = None
    offsets = [offset for offset in range(-_FINE_REACH, _FINE_REACH + 1) if offset]
    coarse = [np.full(shape, index, np.intp) for index in range(0, n_ratios, _COARSE_STEP)]
    for fine in (False, True):
        candidates = [np.clip(best_index + offset, 0, n_ratios - 1) for offset in offsets] if fine else coarse
        for index in candidates:
            error = evaluate(index)
            if best_error is None:
                best_index, best_error = index, error
                continue
            better = error < best_error
            best_index = np.where(better, index, best_index)
            best_error = np.where(better, error, best_error)
    return best_index


def _search_symmetric(blocks, *, qmin, qmax, scale_dtype, ratios, container):
    """:func:`_search` for symmetric types (zero point 0), with fewer passes over the block per ratio.

    The squared error of scale ``s`` is ``s**2 * sum((q - u)**2)`` with ``u = w / s`` and ``q =
    clip(rint(u))``: the integers are the ones stored (the same division), the error is the same up
    to float rounding. The absolute maximum is taken once; the integers of the chosen scale are
    computed at the end by the same operations on the same values.
    """
    amax = np.abs(blocks).max(axis=1)
    ratios = np.asarray(ratios)
    u, work = np.empty_like(blocks), np.empty_like(blocks)

    def scale_of(index):
        return _round_scale(amax * ratios[index] / qmax, scale_dtype)

    def evaluate(index):
        scale = scale_of(index)
        np.divide(blocks, np.where(scale == 0, 1.0, scale)[:, None, :], out=u)
        np.rint(u, out=work)
        np.clip(work, qmin, qmax, out=work)
        np.subtract(work, u, out=work)
        error = np.einsum("ijk,ijk->ik", work, work)
        error *= scale * scale
        return error

    best_scale = scale_of(_coarse_to_fine(evaluate, amax.shape, len(ratios)))
    q = _symmetric_integers(blocks, best_scale, qmin, qmax, out=work)
    return best_scale, np.zeros_like(best_scale), q.astype(np.int16).astype(container)


def _symmetric_integers(blocks, scale, qmin, qmax, *, out):
    """``clip(rint(blocks / scale), qmin, qmax)`` per block (0 where the scale is 0), into ``out``."""
    zero = scale == 0
    np.divide(blocks, np.where(zero, 1.0, scale)[:, None, :], out=out)
    np.rint(out, out=out)
    np.clip(out, qmin, qmax, out=out)
    if zero.any():
        np.copyto(out, 0.0, where=zero[:, None, :])
    return out


def _search(blocks, *, symmetric, qmin, qmax, scale_dtype, ratios, container):
    """``(scale, zero_point, q)`` of ``blocks[n, block_size, N]``: per block, the ratio of least squared error."""
    if symmetric:
        return _search_symmetric(blocks, qmin=qmin, qmax=qmax, scale_dtype=scale_dtype, ratios=ratios,
                                 container=container)
    ratios = np.asarray(ratios)
    shape = (blocks.shape[0], blocks.shape[2])

    def evaluate(index):
        scale, zero_point = _candidate(blocks, ratios[index], symmetric, qmin, qmax, scale_dtype)
        q = _quantize_with(blocks, scale, zero_point, qmin, qmax)
        return (((q - zero_point[:, None, :]) * scale[:, None, :] - blocks) ** 2).sum(axis=1)

    best = ratios[_coarse_to_fine(evaluate, shape, len(ratios))]
    scale, zero_point = _candidate(blocks, best, symmetric, qmin, qmax, scale_dtype)
    q = _quantize_with(blocks, scale, zero_point, qmin, qmax)  # each block's integers at its best ratio
    return scale, zero_point, q.astype(np.int16).astype(container)


def dequantize_blockwise(quantized: BlockQuantized) -> np.ndarray:
    """``(data - zero_point) * scale`` in float32, scales repeated over their blocks (ONNX DQ)."""
    k = quantized.data.shape[0]
    scale = np.repeat(quantized.scale.astype(np.float32), quantized.block_size, axis=0)[:k]
    zero_point = 0.0
    if quantized.zero_point is not None:
        zero_point = np.repeat(quantized.zero_point.astype(np.float32), quantized.block_size, axis=0)[:k]
    return (quantized.data.astype(np.float32) - zero_point) * scale


def pack_matmul_nbits(quantized: BlockQuantized) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(B, scales, zero_points)`` inputs of ``com.microsoft.MatMulNBits`` for ``quantized``.

    B is uint8 ``[N, n_blocks, block_size * bits / 8]``: column-major blocks of unsigned values,
    two 4-bit values per byte, low nibble first. Signed values are stored with the offset
    ``2**(bits-1)``, which is MatMulNBits' default zero point, so symmetric weights need none.
    """
    k, n = quantized.data.shape
    offset = 0 if quantized.dtype in (ir.DataType.UINT4, ir.DataType.UINT8) else 1 << (quantized.bits - 1)
    unsigned = quantized.data.astype(np.int16) + offset
    n_blocks = quantized.scale.shape[0]
    pad_value = offset if quantized.zero_point is None else 0
    padded = np.full((n_blocks * quantized.block_size, n), pad_value, np.int16)
    padded[:k] = unsigned
    columns = padded.T.reshape(n, n_blocks, quantized.block_size).astype(np.uint8)
    if quantized.bits == 4:
        columns = columns[..., 0::2] | (columns[..., 1::2] << 4)
    scales = np.ascontiguousarray(quantized.scale.T).reshape(-1)
    if quantized.zero_point is None:
        return np.ascontiguousarray(columns), scales, None
    zero_points = quantized.zero_point.T.astype(np.uint8)  # [N, n_blocks]
    if quantized.bits == 4:
        if n_blocks % 2:
            zero_points = np.concatenate([zero_points, np.zeros((n, 1), np.uint8)], axis=1)
        zero_points = zero_points[:, 0::2] | (zero_points[:, 1::2] << 4)
    return np.ascontiguousarray(columns), scales, np.ascontiguousarray(zero_points).reshape(-1)
