"""Why ORT CPU leaves a heavy op of the input graph in float: the QDQ shape its selectors refused.

Every check reads the input graph around one heavy op (its input/weight DequantizeLinear, its
output QuantizeLinear and any activation in between) and names the reason as ORT's QDQ selectors
would refuse the node unit, plus the kenosis rule that removes it when one exists.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core import model_io, op_tables
from kenosis_rewrite.diagnosis.ort_graph import FLOAT_HEAVY_OPS, node_input
from kenosis_rewrite.graph import qdq_params, value_range

# Float activations ORT CPU has no QLinear kernel for (they stay float islands in a QDQ graph).
NO_INTEGER_KERNEL_ACTIVATIONS = frozenset(
    {"HardSwish", "HardSigmoid", "PRelu", "Gelu", "Erf", "Div", "Tanh", "Elu", "Selu", "Softplus", "Mish"}
)
# Activations ORT absorbs into QLinearConv/QLinearMatMul/QGemm when the next Q makes them redundant.
ABSORBABLE_ACTIVATIONS = op_tables.ORT_ABSORBED_ACTIVATIONS
# Heavy ops ORT fuses without an output Q (MatMulIntegerToFloat, QGemm with float output).
FLOAT_OUTPUT_OK = op_tables.INTEGER_WITH_FLOAT_OUTPUT_OPS
# Heavy ops ORT CPU never fuses from QDQ (measured: DQ -> ConvTranspose -> Q stays float).
NO_QDQ_FUSION_OPS = frozenset({"ConvTranspose"})
EIGHT_BIT_ONNX = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
BIAS_RTOL = 1e-5

# Reasons (the text) and the fixing rules (kenosis rule names).
R_MISSING = "missing Q/DQ"
R_FLOAT_WEIGHTS = "float weights"
R_UNSUPPORTED_TYPE = "unsupported quantized type on ORT CPU"
R_FANOUT = "int8 fan-out"
R_INT8_NO_Q = "int8 activation without a single-consumer Q->DQ pair"
R_GRAPH_OUTPUT = "output not quantized (graph output)"
R_ZP_NOT_QMIN = "zero point not qmin after Relu/Clip"
R_ACTIVATION = "activation with no integer fusion between op and Q"
R_DTYPE = "dtype mismatch"
R_STALE_BIAS = "stale bias scale"
R_BIAS_TYPE = "bias not int32"
R_PER_AXIS_ACTIVATION = "per-axis activation quantization"
R_WEIGHT_ONLY = "weight-only MatMul not fused to MatMulNBits"
R_NO_KERNEL = "no QDQ fusion for this op type on ORT CPU"
R_UNKNOWN = "unknown (ORT did not fuse)"
R_ACTIVATION_PRODUCT = "product of two activations (attention), float by design"
RULE_U8 = "activation-int8-to-uint8"
RULE_STALE_BIAS = "requantize-stale-bias"
RULE_FOLD = {"Relu": "fold-relu-island", "Clip": "fold-clip-island"}
# an op -> Relu/Clip -> Q(zp != qmin) chain: the activation applied to the Q's codes (exact)
RULE_ON_CODES = {"Relu": "relu-on-codes", "Clip": "clip-on-codes"}
RULE_PRELU = "prelu-to-leakyrelu / prelu-to-relu-min"


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason a heavy op stays float: its text (R_*), the fixing rule (or None) and the evidence."""

    text: str
    rule: str | None
    detail: str


def _dq_of(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear producing ``value`` (looking through a Transpose/Reshape of a weight)."""
    producer = value.producer() if value is not None else None
    if producer is not None and producer.op_type in ("Transpose", "Reshape") and producer.domain in ("", "ai.onnx"):
        producer = node_input(producer, 0).producer() if node_input(producer, 0) is not None else None
    return producer if qdq_params.is_dequantize(producer) else None


def _consumer_count(value: ir.Value) -> int:
    """Nodes that finally read the float tensor behind quantized ``value`` (through its DQs)."""
    count = 1 if value.is_graph_output() else 0
    for node, _ in value.uses():
        if qdq_params.is_dequantize(node):
            out = node.outputs[0]
            count += len(list(out.uses())) + (1 if out.is_graph_output() else 0)
        else:
            count += 1
    return count


def _output_quantizer(node: ir.Node) -> tuple[ir.Node | None, ir.Node | None, list[ir.Node]]:
    """(activation between op and Q, the Q, every consumer of the op's output)."""
    output = node.outputs[0]
    users = [use[0] for use in output.uses()]
    if len(users) != 1:
        return None, None, users
    user = users[0]
    if qdq_params.is_quantize(user):
        return None, user, users
    after = [use[0] for use in user.outputs[0].uses()] if user.outputs else []
    if len(after) == 1 and qdq_params.is_quantize(after[0]) and not user.outputs[0].is_graph_output():
        return user, after[0], users
    return user, None, users


def _params(node: ir.Node | None) -> qdq_params.QuantParams | None:
    return qdq_params.quant_params(node) if node is not None else None


def _type_name(params: qdq_params.QuantParams) -> str:
    return params.dtype.name.lower()


def _weight_and_input(node: ir.Node) -> tuple[int, int]:
    """(activation index, weight index): for MatMul the weight is the side with a constant behind its DQ."""
    if node.op_type == "MatMul":
        dq0 = _dq_of(node_input(node, 0))
        if dq0 is not None and node_input(dq0, 0) is not None and node_input(dq0, 0).is_initializer():
            return 1, 0
    return 0, 1


def _effective_dtype(dq_or_q: ir.Node, quantized: ir.Value) -> tuple[ir.DataType, str | None]:
    """dtype ORT ends up with on x86 and, for int8, why QDQS8ToU8 could not convert it."""
    params = qdq_params.quant_params(dq_or_q)
    if params is None:
        return ir.DataType.UNDEFINED, None
    if params.dtype != ir.DataType.INT8:
        return params.dtype, None
    producer = quantized.producer()
    fanout = _consumer_count(quantized)
    if fanout > 1:
        return ir.DataType.INT8, "fanout"
    if not qdq_params.is_quantize(producer):
        return ir.DataType.INT8, "noq"
    return ir.DataType.UINT8, None


def _check_missing(node: ir.Node, x_dq, w_dq, activation, out_q, users) -> list[Reason]:
    """Inputs without DequantizeLinear, and an output without QuantizeLinear where ORT needs one."""
    x_i, w_i = _weight_and_input(node)
    missing = []
    if x_dq is None:
        missing.append(f"input {node_input(node, x_i).name!r} has no DequantizeLinear")
    if w_dq is None:
        missing.append(f"weight {node_input(node, w_i).name!r} has no DequantizeLinear")
    w_p = _params(w_dq)
    if (x_dq is None and w_dq is None and node.op_type == "MatMul"
            and not any(qdq_params.const_array(v) is not None for v in node.inputs[:2])):
        # attention scores/context: quantize()'s weighted plan leaves them float on purpose
        detail = ("both operands are computed tensors (attention scores or context); quantize() keeps them "
                  "float: int8 measured slower on ORT CPU (kenosis_rewrite.quantization.plan)")
        return [Reason(R_ACTIVATION_PRODUCT, None, detail)]
    if x_dq is None and w_p is not None and w_p.dtype not in qdq_params.EIGHT_BIT and node.op_type == "MatMul":
        missing = []  # weight-only quantization: a float input is expected
        detail = f"{w_p.describe()} weight with a float input was not fused into MatMulNBits"
        reasons = [Reason(R_WEIGHT_ONLY, None, detail)]
    elif x_dq is None and w_dq is None and node.metadata_props.get(model_io.FLOAT_INPUT_KEY):
        detail = (f"input {node_input(node, x_i).name!r} and weight {node_input(node, w_i).name!r} are float: ORT ran "
                  "this op in float, so fix() dropped the quantizer that served only such ops and gave it float "
                  "weights (float-kernels-read-float, float-weights-for-float-kernels)")
        reasons = [Reason(R_FLOAT_WEIGHTS, None, detail)]
    elif x_dq is not None and w_dq is None and qdq_params.const_array(node_input(node, w_i)) is not None:
        # fix() gives the ops ORT runs in float their weights as float constants: say so, not "unquantized"
        detail = (f"weight {node_input(node, w_i).name!r} is a float constant with a quantized input (what fix() "
                  "writes for an op ORT runs in float: float-weights-for-float-kernels; any reason below is why)")
        reasons = [Reason(R_FLOAT_WEIGHTS, None, detail)]
    else:
        detail = "; ".join(missing) + " (not quantized by the quantizer)"
        reasons = [Reason(R_MISSING, None, detail)] if missing else []
    output = node.outputs[0]
    if output.is_graph_output() and node.op_type not in FLOAT_OUTPUT_OK:
        detail = f"{output.name!r} is a graph output; ORT never fuses an op producing one"
        reasons.append(Reason(R_GRAPH_OUTPUT, None, detail))
    elif out_q is None:
        reasons.extend(_output_without_q(node, activation, users))
    return reasons


def _output_without_q(node: ir.Node, activation: ir.Node | None, users: list[ir.Node]) -> list[Reason]:
    """Why the op's output reaches no QuantizeLinear (MatMul/Gemm may legally end in float)."""
    output = node.outputs[0]
    if activation is not None and activation.outputs and activation.outputs[0].is_graph_output():
        detail = f"{activation.op_type} output {activation.outputs[0].name!r} is a graph output"
        return [Reason(R_GRAPH_OUTPUT, None, detail)]
    if node.op_type in FLOAT_OUTPUT_OK:
        return []
    if len(users) > 1:
        names = ", ".join(sorted(u.op_type for u in users))
        detail = f"output {output.name!r} is read by {len(users)} ops ({names}) without a QuantizeLinear"
        return [Reason(R_MISSING, None, detail)]
    if activation is not None and activation.op_type not in ABSORBABLE_ACTIVATIONS:
        return [Reason(R_ACTIVATION, None,
                        f"{activation.op_type} follows the op with no QuantizeLinear in between; ORT only absorbs "
                        "Relu/Clip (quantize the op output: Q/DQ before the activation)")]
    return [Reason(R_MISSING, None, f"output {output.name!r} has no QuantizeLinear")]


def _check_types(x_p, w_p, y_p) -> list[Reason]:
    """Non-8-bit or blocked activation/weight Q/DQ: no ORT CPU kernel takes them."""
    bad = []
    for role, params in (("input", x_p), ("weight", w_p), ("output", y_p)):
        if params is not None and params.dtype not in qdq_params.EIGHT_BIT:
            bad.append(f"{role} {_type_name(params)}")
        elif params is not None and params.block_size:
            bad.append(f"{role} blocked (block_size={params.block_size})")
    if not bad:
        return []
    return [Reason(R_UNSUPPORTED_TYPE, None, ", ".join(bad) + " (ORT CPU fuses only 8-bit Q/DQ)")]


def _check_int8(x_dq, x_eff, out_q, y_eff) -> list[Reason]:
    reasons = []
    for role, node, (dtype, why) in (("input", x_dq, x_eff), ("output", out_q, y_eff)):
        if node is None or dtype != ir.DataType.INT8:
            continue
        tensor = node_input(node, 0) if role == "input" else node.outputs[0]
        if why == "fanout":
            reasons.append(Reason(R_FANOUT, RULE_U8,
                                   f"int8 {role} {tensor.name!r} is read by {_consumer_count(tensor)} ops, so "
                                   "ORT's QDQS8ToU8 leaves it int8 and its producer and consumers run float"))
        else:
            reasons.append(Reason(R_INT8_NO_Q, RULE_U8,
                                   f"int8 {role} {tensor.name!r} has no QuantizeLinear ORT could convert to uint8"))
    return reasons


def _check_activation(activation: ir.Node | None, out_q: ir.Node | None, y_p) -> list[Reason]:
    """An op -> activation -> Q chain ORT cannot fuse (zp != qmin, Clip range too narrow, other activation)."""
    if activation is None or out_q is None:
        return []
    if activation.op_type not in ABSORBABLE_ACTIVATIONS:
        return [Reason(R_ACTIVATION, None,
                        f"{activation.op_type} between the op and its QuantizeLinear: ORT only absorbs Relu/Clip "
                        "(keep a Q/DQ pair before the activation)")]
    if y_p is None or not y_p.is_per_tensor or y_p.dtype not in qdq_params.EIGHT_BIT:
        return []
    zp, scale = y_p.scalar_zero_point, y_p.scalar_scale
    rule = RULE_ON_CODES[activation.op_type]
    if activation.op_type == "Relu":
        if zp != y_p.qmin:
            return [Reason(R_ZP_NOT_QMIN, rule, f"Relu -> Q with zero point {zp}, ORT drops Relu only at {y_p.qmin}")]
        return []
    if value_range.absorbed_by_quantizer(activation, y_p):
        return []
    return [Reason(R_ZP_NOT_QMIN, rule,
                    f"{activation.op_type}{value_range.activation_bounds(activation)} -> Q(s={scale:.6g}, zp={zp}) is not "
                    "redundant: ORT drops Clip only when the Q range lies inside the Clip bounds")]


def _check_dtype(x_eff, y_eff, x_p, y_p) -> list[Reason]:
    x_dtype, y_dtype = x_eff[0], y_eff[0]
    if x_p is None or y_p is None or ir.DataType.INT8 in (x_dtype, y_dtype) or x_dtype == y_dtype:
        return []
    return [Reason(R_DTYPE, None, f"input is {x_dtype.name.lower()} but output is {y_dtype.name.lower()}; "
                                   "ORT needs the same activation type on both sides")]


def _check_bias(node: ir.Node, x_p, w_p) -> list[Reason]:
    bias = node_input(node, 2) if node.op_type in ("Conv", "Gemm", "ConvTranspose") else None
    if bias is None or x_p is None or w_p is None:
        return []
    b_dq = _dq_of(bias)
    if b_dq is None:  # ORT's WeightBiasQuantization quantizes a float bias itself (measured)
        return []
    b_p = qdq_params.quant_params(b_dq)
    if b_p is None:
        return []
    if b_p.dtype != ir.DataType.INT32:  # Quark's XINT8 preset: int8 biases with their own scale (measured: float)
        return [Reason(R_BIAS_TYPE, RULE_STALE_BIAS,
                       f"the bias is {b_p.dtype.name.lower()}; ORT fuses only an int32 bias at input scale x weight scale")]
    expected = np.asarray(x_p.scale, np.float64).reshape(-1) * np.asarray(w_p.scale, np.float64).reshape(-1)
    actual = np.asarray(b_p.scale, np.float64).reshape(-1)
    if actual.size not in (1, expected.size) and expected.size != 1:
        return []
    if np.allclose(actual, expected, rtol=BIAS_RTOL, atol=0.0):
        return []
    return [Reason(R_STALE_BIAS, RULE_STALE_BIAS,
                    f"bias scale {actual.reshape(-1)[0]:.6g} != input scale x weight scale "
                    f"{expected.reshape(-1)[0]:.6g}")]


def _check_per_axis(x_p, y_p) -> list[Reason]:
    """Per-axis activation Q/DQ (measured: the Conv stays float); per-channel *weights* are fine."""
    reasons = []
    for role, params in (("input", x_p), ("output", y_p)):
        if params is not None and not params.is_per_tensor:
            detail = f"{role} is quantized per axis; ORT needs scalar activation parameters"
            reasons.append(Reason(R_PER_AXIS_ACTIVATION, None, detail))
    return reasons


def explain_float_op(node: ir.Node) -> list[Reason]:
    """Every reason found in the input graph why ORT CPU would run heavy ``node`` in float, most likely first."""
    x_i, w_i = _weight_and_input(node)
    x_dq, w_dq = _dq_of(node_input(node, x_i)), _dq_of(node_input(node, w_i))
    activation, out_q, users = _output_quantizer(node)
    reasons = _check_missing(node, x_dq, w_dq, activation, out_q, users)
    x_p, w_p, y_p = _params(x_dq), _params(w_dq), _params(out_q)
    reasons += _check_types(x_p, w_p, y_p)
    if any(r.text in (R_UNSUPPORTED_TYPE, R_WEIGHT_ONLY) for r in reasons):
        return _dedupe(reasons)
    x_eff = _effective_dtype(x_dq, node_input(x_dq, 0)) if x_dq is not None else (ir.DataType.UNDEFINED, None)
    y_eff = _effective_dtype(out_q, out_q.outputs[0]) if out_q is not None else (ir.DataType.UNDEFINED, None)
    reasons += _check_int8(x_dq, x_eff, out_q, y_eff)
    reasons += _check_activation(activation, out_q, y_p)
    reasons += _check_dtype(x_eff, y_eff, x_p, y_p)
    reasons += _check_bias(node, x_p, w_p)
    reasons += _check_per_axis(x_p, y_p)
    if node.op_type in NO_QDQ_FUSION_OPS and x_dq is not None and w_dq is not None:
        reasons.append(Reason(R_NO_KERNEL, None, f"ORT CPU has no QLinear{node.op_type} fusion; it runs float"))
    return _dedupe(reasons) or [Reason(R_UNKNOWN, None, "no known blocker found in the input graph")]


def _dedupe(reasons: list[Reason]) -> list[Reason]:
    seen, unique = set(), []
    for reason in reasons:
        if (reason.text, reason.detail) not in seen:
            seen.add((reason.text, reason.detail))
            unique.append(reason)
    return unique


def integer_warning(node: ir.Node) -> str | None:
    """A problem ORT fused anyway: a Gemm with a stale int32 bias scale runs with wrong numerics (measured)."""
    if node.op_type not in FLOAT_HEAVY_OPS:
        return None
    x_i, w_i = _weight_and_input(node)
    stale = _check_bias(node, _params(_dq_of(node_input(node, x_i))), _params(_dq_of(node_input(node, w_i))))
    if not stale:
        return None
    return f"{R_STALE_BIAS} (fused anyway, numerics off: {stale[0].detail}) -> fix: {RULE_STALE_BIAS}"
