"""What :mod:`kenosis_rewrite.calibration.ort_static` takes from onnxruntime's quantizer internals.

``onnxruntime.quantization.quantize_static`` is public; its ``QDQQuantizer`` and ``ONNXModel`` are
importable but undocumented, and the methods ort_static overrides or calls to compute per-channel
weight parameters a whole tensor at a time are private. Here they are behind public hooks
(:class:`QDQQuantizer`, :class:`ONNXModel`), and the one process-wide change, pointing ORT's
quantizer modules' ``find_by_name`` at an indexed lookup, is scoped
(:func:`indexed_initializer_lookups`). ``tests/unit/_upstream/test_internals.py`` fails when one
of them moves.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator

import onnx
from onnxruntime.quantization import base_quantizer, onnx_model, qdq_quantizer, quant_utils
from onnxruntime.quantization.operators import conv as conv_operator
from onnxruntime.quantization.operators import gemm as gemm_operator
from onnxruntime.quantization.operators import matmul as matmul_operator

__all__ = ["ONNXModel", "NameIndexed", "PRIVATE_QUANTIZER_METHODS", "QDQQuantizer", "check_static_quant_arguments",
           "indexed_initializer_lookups", "quantizer_hooks_available"]

# The private methods of onnxruntime.quantization.qdq_quantizer.QDQQuantizer this module overrides
# or calls (seen in onnxruntime 1.20 - 1.32). Public replacement: none public today.
PRIVATE_QUANTIZER_METHODS = ("_calc_initializer_quant_params", "_adjust_weight_scale_for_int32_bias",
                             "_add_qdq_nodes_for_initializer", "_make_scale_zp_initializers", "_create_dq_node")


def quantizer_hooks_available() -> bool:
    """Whether this onnxruntime's ``QDQQuantizer`` has every private method :class:`QDQQuantizer` relies on."""
    return all(hasattr(qdq_quantizer.QDQQuantizer, name) for name in PRIVATE_QUANTIZER_METHODS)


class QDQQuantizer(qdq_quantizer.QDQQuantizer):
    """ORT's ``QDQQuantizer``, the private methods a subclass overrides or calls under public names.

    Internal: ``QDQQuantizer._calc_initializer_quant_params``, ``._adjust_weight_scale_for_int32_bias``,
    ``._add_qdq_nodes_for_initializer`` (overridden through :meth:`initializer_quant_params_of_all`,
    :meth:`adjusted_weight_scale_for_int32_bias`, :meth:`add_initializer_qdq_nodes`) and
    ``._make_scale_zp_initializers``, ``._create_dq_node`` (called), seen in onnxruntime 1.20 - 1.32.
    Public replacement: none public today (``quantize_static`` runs the quantizer whole)."""

    def _calc_initializer_quant_params(self) -> dict:
        return self.initializer_quant_params_of_all()

    def _adjust_weight_scale_for_int32_bias(self, input_scale, weight_scale, weight_name, bias_tp, is_per_channel):
        return self.adjusted_weight_scale_for_int32_bias(input_scale, weight_scale, weight_name, bias_tp,
                                                         is_per_channel)

    def _add_qdq_nodes_for_initializer(self, weight_proto: onnx.TensorProto):
        return self.add_initializer_qdq_nodes(weight_proto)

    def initializer_quant_params_of_all(self) -> dict:
        """ORT's quantization parameters (scale, zero point, type, axis) of every initializer it
        quantizes, by name, in the order of ``tensors_to_quantize``."""
        return super()._calc_initializer_quant_params()

    def adjusted_weight_scale_for_int32_bias(self, input_scale, weight_scale, weight_name, bias_tp, is_per_channel):
        """ORT's ``(adjusted?, weight_scale)``: the weight scale raised where the bias scale
        (input scale x weight scale) would overflow int32; it updates ``weight_scale`` in place."""
        return super()._adjust_weight_scale_for_int32_bias(input_scale, weight_scale, weight_name, bias_tp,
                                                           is_per_channel)

    def add_initializer_qdq_nodes(self, weight_proto: onnx.TensorProto):
        """ORT's quantized initializer and its DequantizeLinear (or Q -> DQ pair) for ``weight_proto``."""
        return super()._add_qdq_nodes_for_initializer(weight_proto)

    def make_scale_zp_initializers(self, name: str, params):
        """ORT's scale and zero-point initializers of ``name`` for ``params``, added to the model."""
        return self._make_scale_zp_initializers(name, params)

    def create_dq_node(self, dq_input: str, dq_output: str, node_name: str, scale_name: str, zp_name: str,
                       axis: int | None = None, block_size: int = 0) -> None:
        """ORT's DequantizeLinear node, added to the model."""
        self._create_dq_node(dq_input, dq_output, node_name, scale_name, zp_name, axis=axis, block_size=block_size)


class ONNXModel(onnx_model.ONNXModel):
    """ORT's quantizer model wrapper, its initializer check under a public name.

    Internal: ``onnxruntime.quantization.onnx_model.ONNXModel._check_init(init, test=None)`` (what
    ``add_initializer`` and the save check: float8 NaN bytes), seen in onnxruntime 1.20 - 1.32.
    Public replacement: none public today."""

    def check_initializer(self, init: onnx.TensorProto, stage: str | None = None):
        """ORT's check of ``init`` (``stage`` is ORT's ``test`` argument: ``"end"`` as its save checks)."""
        return self._check_init(init, stage)


class NameIndexed:
    """A sequence of initializers that finds the first of a name without walking them: the argument
    on which the lookup :func:`indexed_initializer_lookups` installs answers without ORT's walk."""

    def first_named(self, name: str) -> onnx.TensorProto | None:
        """The first initializer named ``name``, or None (what ORT's ``find_by_name`` returns)."""
        raise NotImplementedError


_ORTS_FIND_BY_NAME = quant_utils.find_by_name
# the ORT quantization modules that call find_by_name on ``model.initializer()`` (onnxruntime 1.20 - 1.32)
_FIND_BY_NAME_CALLERS = (base_quantizer, qdq_quantizer, onnx_model, conv_operator, gemm_operator, matmul_operator)
_lookups_lock = threading.Lock()
_lookups_depth = 0
_rebound: list = []


def _find_by_name(item_name, item_list):
    """ORT's ``find_by_name`` (the first item of that name, or None); on a :class:`NameIndexed`,
    its indexed lookup instead of a walk over every initializer (ORT looks up each tensor it
    quantizes several times: 4,086 walks over 200-odd initializers on PP-OCR cls, half of its
    quantize_static)."""
    if isinstance(item_list, NameIndexed):
        return item_list.first_named(item_name)
    return _ORTS_FIND_BY_NAME(item_name, item_list)


@contextlib.contextmanager
def indexed_initializer_lookups() -> Iterator[None]:
    """While the block runs, ORT's quantizer modules call :func:`_find_by_name`; ORT's own function
    is put back when the last such block (of any thread) ends. It dispatches on its argument alone
    and is ORT's own function on anything but a :class:`NameIndexed`: any other quantization in the
    process meanwhile sees ORT's behaviour, and a lookup outside the block gives the same answer by
    ORT's walk.

    Internal: the module attribute ``find_by_name`` that ``base_quantizer``, ``qdq_quantizer``,
    ``onnx_model`` and ``operators.{conv,gemm,matmul}`` import from ``quant_utils`` (seen in
    onnxruntime 1.20 - 1.32). Public replacement: none public today."""
    global _lookups_depth
    with _lookups_lock:
        if _lookups_depth == 0:
            _rebound[:] = [module for module in _FIND_BY_NAME_CALLERS
                           if getattr(module, "find_by_name", None) is _ORTS_FIND_BY_NAME]
            for module in _rebound:
                module.find_by_name = _find_by_name
        _lookups_depth += 1
    try:
        yield
    finally:
        with _lookups_lock:
            _lookups_depth -= 1
            if _lookups_depth == 0:
                for module in _rebound:
                    if module.find_by_name is _find_by_name:
                        module.find_by_name = _ORTS_FIND_BY_NAME
                _rebound.clear()


def check_static_quant_arguments(quant_format, activation_type, weight_type) -> None:
    """quantize_static's check of its format and types (raises ValueError on a combination it refuses).

    Internal: ``onnxruntime.quantization.quantize.check_static_quant_arguments``, a function of an
    undocumented module that ``onnxruntime.quantization`` does not re-export (it re-exports
    ``quantize`` the function under the module's name), seen in onnxruntime 1.20 - 1.32. Public
    replacement: none public today."""
    module = importlib.import_module("onnxruntime.quantization.quantize")
    module.check_static_quant_arguments(quant_format, activation_type, weight_type)
