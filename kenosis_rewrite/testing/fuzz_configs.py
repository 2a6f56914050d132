"""``quantize_static`` configurations for the property fuzz (:mod:`kenosis_rewrite.testing.fuzz`).

:func:`random_quant_config` draws one from a ``np.random.Generator``; :func:`quantize_with_config`
applies it (None when ``quantize_static`` itself refuses the model: a skipped case, not a finding).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kenosis_rewrite.core.ort_quantize import quiet_logger
from kenosis_rewrite.testing.fuzz_models import QUANTIZABLE_WEIGHTED
from kenosis_rewrite.testing.fuzz_running import first_line, run_model

_EXTRA_OPTION_KEYS = (
    "ActivationSymmetric", "WeightSymmetric", "AddQDQPairToWeight", "DedicatedQDQPair",
    "QDQKeepRemovableActivations", "ForceQuantizeNoInputCheck",
)


def plain_quant_config() -> dict:
    """The reference configuration of :func:`check_quantize_case`: u8 activations, s8 per-channel weights."""
    return {"activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": True}


def _op_types_subset(rng: np.random.Generator, op_types: list[str]) -> list[str]:
    """A random non-empty subset of ``op_types``, usually with one weighted op in it."""
    chosen = [op for op in op_types if rng.random() < 0.5]
    weighted = [op for op in op_types if op in QUANTIZABLE_WEIGHTED]
    if weighted and rng.random() < 0.8:
        chosen.append(weighted[int(rng.integers(len(weighted)))])
    if not chosen:
        chosen.append(op_types[int(rng.integers(len(op_types)))])
    return sorted(set(chosen))


def random_quant_config(rng: np.random.Generator, op_types: list[str] | None = None) -> dict:
    """A random, JSON-able ``quantize_static`` configuration (see :func:`quantize_with_config`).

    ``op_types``: the op types of the model; when given, one config in five restricts
    ``op_types_to_quantize`` to a random subset of them.
    """
    sixteen = rng.random() < 0.12
    if sixteen:
        activation = "QUInt16" if rng.random() < 0.5 else "QInt16"
        weight = ["QInt8", "QUInt8", "QInt16"][int(rng.integers(3))]
    else:
        activation = "QUInt8" if rng.random() < 0.5 else "QInt8"
        # quantize_static refuses int8 activations with uint8 weights: never draw that pair.
        weight = "QUInt8" if activation == "QUInt8" and rng.random() < 0.3 else "QInt8"
    roll = rng.random()
    config = {
        "activation_type": activation,
        "weight_type": weight,
        "per_channel": bool(rng.random() < 0.5),
        "reduce_range": bool(rng.random() < 0.2),
        "calibrate_method": "MinMax" if roll < 0.92 else ("Percentile" if roll < 0.96 else "Entropy"),
        "extra_options": {key: True for key in _EXTRA_OPTION_KEYS if rng.random() < 0.2},
        "use_contrib_ops": bool(rng.random() < 0.05),
        # Post-processing, not a quantize_static option: Q/DQ scales and zero points as Constant
        # nodes instead of initializers, as torch.onnx exports of QAT models have them.
        "qparams_as_constant_nodes": bool(rng.random() < 0.08),
    }
    if op_types and rng.random() < 0.2:
        config["op_types_to_quantize"] = _op_types_subset(rng, sorted(set(op_types)))
    # Post-processing too: every Concat's inputs and output on one grid, as NNCF's and Quark's
    # unified scales put them (drawn from a stream of its own: rng's draws stay those of before)
    if np.random.Generator(rng.bit_generator.jumped(2)).random() < 0.15:
        config["unified_concat_grids"] = True
    return config


def _static_kwargs(config: dict) -> dict:
    """quantize_static keyword arguments of a JSON config."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType  # noqa: PLC0415

    extra = dict(config.get("extra_options", {}))
    if config.get("use_contrib_ops"):
        extra["UseQDQContribOps"] = True
    kwargs = {
        "quant_format": QuantFormat.QDQ,
        "activation_type": QuantType[config.get("activation_type", "QUInt8")],
        "weight_type": QuantType[config.get("weight_type", "QInt8")],
        "per_channel": bool(config.get("per_channel", False)),
        "reduce_range": bool(config.get("reduce_range", False)),
        "calibrate_method": CalibrationMethod[config.get("calibrate_method", "MinMax")],
        "extra_options": extra,
    }
    if config.get("op_types_to_quantize"):
        kwargs["op_types_to_quantize"] = list(config["op_types_to_quantize"])
    return kwargs


@contextlib.contextmanager
def silenced():
    """quantize_static logs warnings and its histogram calibrators print: keep the fuzz output readable."""
    with quiet_logger(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def quantize_or_skip(fp32: onnx.ModelProto, config: dict, feeds) -> tuple[onnx.ModelProto | None, str | None]:
    """(QDQ model, None), or (None, why it was skipped): quantize_static raised, or ORT cannot load
    its output or run it on the first feed (at either optimization level)."""
    from onnxruntime.quantization import quantize_static  # noqa: PLC0415

    from kenosis_rewrite.core.ort_quantize import FeedsReader  # noqa: PLC0415

    try:
        with tempfile.TemporaryDirectory() as tmp, silenced():
            source, target = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "qdq.onnx")
            onnx.save(fp32, source)
            quantize_static(source, target, FeedsReader(feeds), **_static_kwargs(config))
            model = onnx.load(target)
        if config.get("unified_concat_grids"):
            model = _unified_concat_grids(model)
        if config.get("quantized_parameters"):
            model = _quantized_parameters(model)
        if config.get("qparams_as_constant_nodes"):
            model = _qparams_to_constant_nodes(model)
    except Exception as error:  # noqa: BLE001 - the quantizer raises many unrelated types
        return None, f"quantize_static raised {type(error).__name__}: {first_line(error)}"
    for level in ("disable_all", "enable_all"):
        try:
            run_model(model.SerializeToString(), feeds[:1], level)
        except Exception as error:  # noqa: BLE001
            return None, f"ORT cannot load or run the quantize_static output at {level}: {first_line(error)}"
    return model, None


def _unified_concat_grids(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each Concat of per-tensor dequantized inputs whose every reader is a per-tensor Q of the same
    type, with every one of those quantizers (and every DQ reading them) on one grid: the union of
    the ranges they represented, zero included."""
    initializers = {t.name: t for t in model.graph.initializer}
    producers = {name: node for node in model.graph.node for name in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def params(node):
        if len(node.input) < 3 or node.input[1] not in initializers or node.input[2] not in initializers:
            return None
        scale, zero = (numpy_helper.to_array(initializers[n]) for n in node.input[1:3])
        return (scale, zero) if scale.size == 1 and zero.size == 1 and zero.dtype in (np.uint8, np.int8) else None

    for index, concat in enumerate([n for n in model.graph.node if n.op_type == "Concat"]):
        dequantizers = [producers.get(name) for name in concat.input]
        quantizers = [producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
                      for dq in dequantizers]
        outputs = readers.get(concat.output[0], [])
        group = [q for q in quantizers if q is not None and q.op_type == "QuantizeLinear"] + outputs
        if len(group) != len(quantizers) + len(outputs) or not outputs or any(q.op_type != "QuantizeLinear" for q in group):
            continue
        grids = [params(q) for q in group]
        if any(grid is None for grid in grids) or len({zero.dtype for _, zero in grids}) != 1:
            continue
        dtype = grids[0][1].dtype
        qmin, qmax = (0, 255) if dtype == np.uint8 else (-128, 127)
        lows, highs = zip(*[(float(s) * (qmin - int(z)), float(s) * (qmax - int(z))) for s, z in grids])
        lo, hi = min(min(lows), 0.0), max(max(highs), 0.0)
        scale = np.float32((hi - lo) / (qmax - qmin))
        zero = np.array(np.clip(np.rint(qmin - lo / scale), qmin, qmax), dtype)
        scale_name, zero_name = f"unified_concat_{index}_scale", f"unified_concat_{index}_zero_point"
        model.graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), scale_name),
                                        numpy_helper.from_array(zero, zero_name)])
        for q in group:
            for node in [q, *readers.get(q.output[0], [])]:
                if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                    node.input[1], node.input[2] = scale_name, zero_name
    return model


_PARAMETER_SLOTS = {"PRelu": (1,), "Clip": (1, 2)}


def _quantized_parameters(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float32 initializer read as a PRelu slope or a Clip bound replaced by a DequantizeLinear of
    int8 codes on a power-of-two grid with zero point 0 (Quark's XINT8 constants): the model's values
    become those the codes give."""
    initializers = {t.name: t for t in model.graph.initializer}
    dequantized: dict[str, str] = {}
    added: list[onnx.NodeProto] = []
    for node in model.graph.node:
        for index in _PARAMETER_SLOTS.get(node.op_type, ()):
            name = node.input[index] if len(node.input) > index else ""
            tensor = initializers.get(name)
            if tensor is None or tensor.data_type != onnx.TensorProto.FLOAT:
                continue
            if name not in dequantized:
                values = numpy_helper.to_array(tensor)
                top = float(np.max(np.abs(values))) if values.size else 0.0
                scale = np.float32(2.0 ** np.ceil(np.log2(top / 127.0))) if top > 0 else np.float32(1.0)
                codes = np.clip(np.rint(values / scale), -128, 127).astype(np.int8)
                model.graph.initializer.extend([numpy_helper.from_array(codes, f"{name}_codes"),
                                                numpy_helper.from_array(np.array(scale, np.float32), f"{name}_codes_scale"),
                                                numpy_helper.from_array(np.array(0, np.int8), f"{name}_codes_zero_point")])
                dequantized[name] = f"{name}_dequantized"
                added.append(helper.make_node("DequantizeLinear", [f"{name}_codes", f"{name}_codes_scale",
                                                                   f"{name}_codes_zero_point"], [dequantized[name]]))
            node.input[index] = dequantized[name]
    nodes = added + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _qparams_to_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The Q/DQ scale and zero-point initializers of ``model`` moved into Constant nodes (same names)."""
    qdq_ops = ("QuantizeLinear", "DequantizeLinear")
    names = {name for node in model.graph.node if node.op_type in qdq_ops for name in node.input[1:] if name}
    initializers = {t.name: t for t in model.graph.initializer if t.name in names}
    constants = [
        helper.make_node("Constant", [], [name], name=f"{name}_constant", value=tensor)
        for name, tensor in sorted(initializers.items())
    ]
    kept = [t for t in model.graph.initializer if t.name not in initializers]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    nodes = constants + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def quantize_with_config(fp32: onnx.ModelProto, config: dict, calibration_feeds) -> onnx.ModelProto | None:
    """``quantize_static`` (QDQ) of ``fp32`` in ``config``; None when it raises or ORT cannot load the result."""
    return quantize_or_skip(fp32, config, calibration_feeds)[0]
