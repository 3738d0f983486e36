"""The op variants the gradient audit covers (tests/graph/test_gradient_audit.py), as torch.onnx.export writes them.

Each entry is a :class:`tests.support.audit_graph.Case`; opset 17 unless the op changed later (then 18-20).
"""

from __future__ import annotations

import numpy as np

from tests.support.audit_graph import Branch, Case

F = np.float32


def _unary(op_type: str, offset: float = 0.0, scale: float = 1.0, **attrs):
    return lambda b: b.op(op_type, [b.act((4, 5), scale, offset)], **attrs)


def _levels(b: Branch, levels: list[float], seed: int = 7) -> str:
    """A trained [4, 5] parameter whose entries are +-levels, plus small trained activations (|.| < 0.15 for
    |x| < 3): the sum stays near those levels, away from kinks (Relu/Abs at 0, Clip bounds, Min/Max ties)."""
    rng = np.random.default_rng(seed)
    value = rng.choice(levels, (4, 5)) * rng.choice([-1.0, 1.0], (4, 5))
    return b.op("Add", [b.param((4, 5), value=value), b.act((4, 5), 0.05)])


def _away_from_zero(b: Branch) -> str:
    return _levels(b, [0.3, 0.6, 1.0])


def _pow(exponent: float, offset: float = 0.0):
    return lambda b: b.op("Pow", [b.act((4, 5), 0.5, offset), b.const(exponent, F)])


def _softmax(op_type: str, axis: int):
    return lambda b: b.op(op_type, [b.act((4, 3, 5), 2.0)], axis=axis)


def _slice(starts, ends, axes=None, steps=None, shape=(4, 6, 5)):
    def build(b: Branch) -> str:
        inputs = [b.act(shape), b.const(starts), b.const(ends)]
        if axes is not None:
            inputs.append(b.const(axes))
        if steps is not None:
            inputs.append(b.const(steps))
        return b.op("Slice", inputs)
    return build


def _reduce(op_type: str, axes, keepdims: int, noop: int | None = None, as_input: bool = True, positive=False):
    def build(b: Branch) -> str:
        a = b.act((4, 3, 5), 0.5, 2.0 if positive else 0.0)
        attrs = {"keepdims": keepdims}
        if noop is not None:
            attrs["noop_with_empty_axes"] = noop
        if axes is None:
            out = b.op(op_type, [a], **attrs)
        elif as_input:
            out = b.op(op_type, [a, b.const(axes)], **attrs)
        else:
            out = b.op(op_type, [a], axes=axes, **attrs)
        # A reduction to a scalar scales the activations, so the head still sees [B, ...].
        return b.op("Mul", [a, out]) if axes is None and noop != 1 else out
    return build


def _matmul(a_shape, b_shape, a_param=False):
    def build(b: Branch) -> str:
        if a_param:
            return b.op("MatMul", [b.param(a_shape), b.act(b_shape)])
        return b.op("MatMul", [b.act(a_shape), b.param(b_shape)])
    return build


def _gemm(trans_a: int, trans_b: int, alpha: float, beta: float, bias_shape):
    def build(b: Branch) -> str:
        a = b.act((6, 4) if trans_a else (4, 6))
        w = b.param((5, 6) if trans_b else (6, 5))
        return b.op("Gemm", [a, w, b.param(bias_shape)], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    return build


def _conv(op_type: str, channels: int, out_channels: int, group: int = 1, **attrs):
    def build(b: Branch) -> str:
        kernel = (channels, out_channels // group, 3, 3) if op_type == "ConvTranspose" else (
            out_channels, channels // group, 3, 3)
        return b.op(op_type, [b.act((4, channels, 5, 5)), b.param(kernel, 0.3), b.param((out_channels,), 0.1)],
                    kernel_shape=[3, 3], group=group, **attrs)
    return build


def _pool(op_type: str, **attrs):
    return lambda b: b.op(op_type, [b.act((4, 2, 5, 5))], **attrs)


def _pad(mode: str, pads, axes=None):
    def build(b: Branch) -> str:
        inputs = [b.act((4, 2, 5)), b.const(pads)]
        if mode == "constant" or axes is not None:
            inputs.append(b.const(0.5, F) if mode == "constant" else "")
        if axes is not None:
            inputs.append(b.const(axes))
        return b.op("Pad", inputs, mode=mode)
    return build


def _resize(mode: str, opset: int, **attrs):
    def build(b: Branch) -> str:
        scales = b.const([1.0, 1.0, 2.0, 1.5], F)
        return b.op("Resize", [b.act((4, 2, 3, 4)), "", scales], mode=mode, **attrs)
    return Case(f"resize_{mode}_op{opset}", build, opset)


def _two(op_type: str, second_shape=(5,), positive=False):
    def build(b: Branch) -> str:
        a = b.act((4, 5), 1.0, 3.0 if positive else 0.0)
        return b.op(op_type, [a, b.param(second_shape, 0.5, 3.0 if positive else 0.0)])
    return build


def _where(x_shape, y_shape, y_constant=False):
    def build(b: Branch) -> str:
        cond = b.const(np.random.default_rng(5).random((4, 5)) > 0.5, np.bool_)
        x = b.act(x_shape) if x_shape[0] == 4 else b.param(x_shape)
        y = b.const(-2.0, F) if y_constant else (b.act(y_shape) if y_shape[0] == 4 else b.param(y_shape))
        return b.op("Where", [cond, x, y])
    return build


def _clip(b: Branch) -> str:
    # Bounds at +-0.5; the values stay within 0.15 of +-0.2 or +-0.9.
    a = _levels(b, [0.2, 0.9])
    return b.op("Clip", [a, b.const(-0.5, F), b.const(0.5, F)])


def _minmax(op_type: str):
    # Two trained operands that differ by >= 0.2 everywhere (no ties).
    def build(b: Branch) -> str:
        a = b.act((4, 5))
        return b.op(op_type, [a, b.op("Add", [a, _levels(b, [0.3], seed=8)])])
    return build


def _minmax_broadcast(op_type: str, shape):
    # The second operand broadcast ([C] or [N, 1]); its values sit 0.2..0.35 off the first's row/column levels.
    def build(b: Branch) -> str:
        levels = _levels(b, [0.6, 1.2], seed=9)
        return b.op(op_type, [levels, b.param(shape, 0.02)])
    return build


def _gather(axis: int, indices, table_shape):
    return lambda b: b.op("Gather", [b.act(table_shape), b.const(indices)], axis=axis)


def _layernorm(axis: int, norm_shape):
    def build(b: Branch) -> str:
        return b.op("LayerNormalization", [b.act((4, 3, 5), 2.0, 0.5), b.param(norm_shape, 0.1, 1.0),
                                           b.param(norm_shape, 0.1)], axis=axis, epsilon=1e-5)
    return build


def _batchnorm(read_statistics: bool = False):
    def build(b: Branch) -> str:
        mean, var = b.param((3,), 0.1), b.param((3,), 0.1, 1.0)
        outs = b.op("BatchNormalization", [b.act((4, 3, 5), 2.0, 0.5), b.param((3,), 0.1, 1.0), b.param((3,), 0.1),
                                           mean, var], num_outputs=3, training_mode=1, momentum=0.9, epsilon=1e-5)
        return b.op("Add", [outs[0], b.op("Unsqueeze", [outs[1], b.const([1])])]) if read_statistics else outs[0]
    return build


def _castlike(value):
    """``q * CastLike(value, q)``: the type input ``q`` is read elsewhere too, as the query is in attention."""
    def build(b: Branch) -> str:
        q = b.act((4, 5))
        return b.op("Mul", [q, b.op("CastLike", [value(b, q), q])])
    return build


CASES_17: list[Case] = [
    Case("relu", lambda b: b.op("Relu", [_away_from_zero(b)])),
    Case("leaky_relu", lambda b: b.op("LeakyRelu", [_away_from_zero(b)], alpha=0.1)),
    Case("sigmoid", _unary("Sigmoid", scale=2.0)),
    Case("tanh", _unary("Tanh", scale=2.0)),
    Case("softmax_last", _softmax("Softmax", -1)),
    Case("softmax_mid", _softmax("Softmax", 1)),
    Case("logsoftmax_last", _softmax("LogSoftmax", -1)),
    Case("logsoftmax_mid", _softmax("LogSoftmax", 1)),
    Case("erf", _unary("Erf")),
    Case("exp", _unary("Exp")),
    Case("log", _unary("Log", 3.0, 0.5)),
    Case("sqrt", _unary("Sqrt", 3.0, 0.5)),
    Case("reciprocal", _unary("Reciprocal", 3.0, 0.5)),
    Case("sin", _unary("Sin")),
    Case("cos", _unary("Cos")),
    Case("neg", _unary("Neg")),
    Case("abs", lambda b: b.op("Abs", [_away_from_zero(b)])),
    Case("pow_2", _pow(2.0)),
    Case("pow_3", _pow(3.0)),
    Case("pow_0.5", _pow(0.5, 3.0)),
    Case("div", _two("Div", positive=True)),
    Case("div_both_trained", lambda b: b.op("Div", [b.act((4, 5)), b.act((4, 5), 0.5, 3.0)])),
    Case("sub", _two("Sub")),
    Case("sub_broadcast_left", lambda b: b.op("Sub", [b.param((5,)), b.act((4, 5))])),
    Case("mul_broadcast", _two("Mul", (4, 1))),
    Case("mul_same_input_twice", lambda b: (lambda a: b.op("Mul", [a, a]))(b.act((4, 5)))),
    Case("add_same_input_twice", lambda b: (lambda a: b.op("Add", [a, a]))(b.act((4, 5)))),
    Case("matmul_gram", lambda b: (lambda a: b.op("MatMul", [a, b.op("Transpose", [a], perm=[0, 2, 1])]))(
        b.act((4, 3, 2)))),
    Case("where_same_shapes", _where((4, 5), (4, 5))),
    Case("where_masked_fill_constant", _where((4, 5), (), y_constant=True)),
    Case("where_y_broadcast", _where((4, 5), (5,))),
    Case("where_x_broadcast_rank_up", _where((1, 5), (4, 5))),
    Case("where_x_broadcast_column", _where((4, 1), (4, 5))),
    Case("min", _minmax("Min")),
    Case("max", _minmax("Max")),
    Case("min_broadcast_row", _minmax_broadcast("Min", (5,))),
    Case("max_broadcast_column", _minmax_broadcast("Max", (4, 1))),
    Case("div_broadcast_column", lambda b: b.op("Div", [b.act((4, 5)), b.param((4, 1), 0.3, 2.0)])),
    Case("clip_inputs", _clip),
    Case("expand", lambda b: b.op("Expand", [b.act((4, 1, 5)), b.const([4, 3, 5])])),
    Case("expand_rank_up", lambda b: b.op("Expand", [b.param((1, 5)), b.const([4, 2, 5])])),
    Case("tile", lambda b: b.op("Tile", [b.act((4, 2, 3)), b.const([1, 2, 3])])),
    Case("slice_step2", _slice([0, 1], [6, 5], [1, 2], [2, 2])),
    Case("slice_negative_step", _slice([-1, 4], [-7, 0], [1, 2], [-1, -2])),
    Case("slice_flip", _slice([-1], [-(2**63) + 1], [1], [-1])),
    Case("slice_flip_last_axis", _slice([-1], [-(2**63) + 1], [2], [-1])),
    Case("slice_flip_first_axis", _slice([-1], [-(2**63) + 1], [0], [-1])),
    Case("slice_flip_axis1_of_4d", _slice([-1], [-(2**63) + 1], [1], [-1], shape=(4, 3, 2, 2))),
    Case("slice_neg_end_below", _slice([-1], [-7], [1], [-1])),
    Case("slice_neg_end_m6", _slice([-1], [-6], [1], [-1])),
    Case("slice_neg_end_m100", _slice([5], [-100], [1], [-2])),
    Case("slice_one_neg_of_two", _slice([-1, 0], [-(2**63) + 1, 5], [1, 2], [-1, 2])),
    Case("slice_flip_axes01", _slice([-1, -1], [-(2**63) + 1, -(2**63) + 1], [0, 1], [-1, -1])),
    Case("slice_last_axis_step_m2", _slice([3], [0], [-1], [-2])),
    Case("slice_flip_two_axes", _slice([-1, -1], [-(2**63) + 1, -(2**63) + 1], [1, 2], [-1, -1])),
    Case("slice_neg_two_axes", _slice([-1, 4], [-(2**63) + 1, 0], [1, 2], [-1, -2])),
    Case("slice_negative_step_within", _slice([4], [0], [1], [-2])),
    Case("slice_axes_input", _slice([1], [-1], [-2])),
    Case("slice_no_axes", _slice([0, 1, 1], [4, 5, 4])),
    Case("gather_axis0_negative", _gather(0, [[1, -1], [3, 0]], (4, 5))),
    Case("gather_axis1", _gather(1, [0, -2, 5, 0], (4, 6, 3))),
    Case("gather_scalar_index", _gather(1, -1, (4, 6, 3))),
    Case("gather_elements", lambda b: b.op("GatherElements", [b.act((4, 5)), b.const(
        [[0, 4, 4], [1, 2, 0], [3, 3, 3], [-1, 0, 2]])], axis=1)),
    Case("concat", lambda b: b.op("Concat", [b.act((4, 2)), b.act((4, 3)), b.param((4, 1))], axis=1)),
    Case("concat_negative_axis", lambda b: b.op("Concat", [b.act((4, 2, 2)), b.act((4, 2, 3))], axis=-1)),
    Case("transpose_021", lambda b: b.op("Transpose", [b.act((4, 3, 5))], perm=[0, 2, 1])),
    Case("transpose_201", lambda b: b.op("Transpose", [b.act((4, 3, 5))], perm=[2, 0, 1])),
    Case("squeeze", lambda b: b.op("Squeeze", [b.act((4, 1, 5)), b.const([1])])),
    Case("unsqueeze", lambda b: b.op("Unsqueeze", [b.act((4, 5)), b.const([0, 2])])),
    Case("flatten", lambda b: b.op("Flatten", [b.act((4, 2, 3, 2))], axis=2)),
    Case("reduce_sum_keep0", _reduce("ReduceSum", [1], 0)),
    Case("reduce_sum_keep1_neg", _reduce("ReduceSum", [-1], 1)),
    Case("reduce_sum_all", _reduce("ReduceSum", None, 0)),
    Case("reduce_sum_noop", _reduce("ReduceSum", None, 1, noop=1)),
    Case("reduce_mean_keep0", _reduce("ReduceMean", [1], 0, as_input=False)),
    Case("reduce_mean_keep1", _reduce("ReduceMean", [-1], 1, as_input=False)),
    Case("reduce_mean_all", _reduce("ReduceMean", None, 1)),
    Case("reduce_l2_keep1", _reduce("ReduceL2", [1], 1, as_input=False, positive=True)),
    Case("reduce_logsumexp_keep1", _reduce("ReduceLogSumExp", [1], 1, as_input=False)),
    Case("matmul_3d_2d", _matmul((4, 3, 5), (5, 2))),
    Case("matmul_4d_4d", lambda b: b.op("MatMul", [b.act((4, 1, 2, 3)), b.param((1, 2, 3, 2))])),
    Case("matmul_2d_3d", _matmul((2, 5), (4, 5, 3), a_param=True)),
    Case("matmul_1d", lambda b: b.op("MatMul", [b.act((4, 3, 5)), b.param((5,))])),
    Case("matmul_1d_left", lambda b: b.op("MatMul", [b.param((5,)), b.act((4, 5, 3))])),
    Case("gemm_transB_alpha_beta", _gemm(0, 1, 0.7, 1.3, (5,))),
    Case("gemm_transA_bias_column", _gemm(1, 0, 1.0, 0.5, (4, 1))),
    Case("gemm_both_trans_full_bias", _gemm(1, 1, 1.5, 1.0, (4, 5))),
    Case("layernorm_last", _layernorm(-1, (5,))),
    Case("layernorm_axis1", _layernorm(1, (3, 5))),
    Case("batchnorm_training", _batchnorm()),
    Case("batchnorm_training_statistics_read", _batchnorm(read_statistics=True)),
    Case("conv_stride_pads", _conv("Conv", 2, 3, strides=[2, 2], pads=[1, 1, 1, 1])),
    Case("conv_dilation", _conv("Conv", 2, 3, dilations=[2, 1], pads=[2, 0, 1, 1])),
    Case("conv_group", _conv("Conv", 4, 4, group=2, pads=[1, 1, 1, 1])),
    Case("conv_depthwise", _conv("Conv", 2, 2, group=2, strides=[1, 2])),
    Case("conv_transpose", _conv("ConvTranspose", 2, 3, strides=[2, 2], pads=[1, 1, 1, 1])),
    Case("conv_transpose_outpad", _conv("ConvTranspose", 2, 2, strides=[2, 2], output_padding=[1, 1])),
    Case("maxpool_pads", _pool("MaxPool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    Case("maxpool_ceil", _pool("MaxPool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    Case("avgpool_pads_include", _pool("AveragePool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                       count_include_pad=1)),
    Case("avgpool_pads_exclude", _pool("AveragePool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                       count_include_pad=0)),
    Case("avgpool_ceil", _pool("AveragePool", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    Case("global_avgpool", _pool("GlobalAveragePool")),
    Case("pad_constant", _pad("constant", [0, 1, 2, 0, 0, 1])),
    Case("pad_reflect", _pad("reflect", [0, 0, 2, 0, 0, 1])),
    Case("pad_edge", _pad("edge", [0, 1, 1, 0, 0, 2])),
    _resize("nearest", 17, coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    Case("dropout_ratio_input_eval", lambda b: b.op("Dropout", [b.act((4, 5)), b.const(0.3, F)])),
    Case("dropout_mask_declared", lambda b: b.op("Dropout", [b.act((4, 5)), b.const(0.5, F)], num_outputs=2)[0]),
    Case("dropout_mode_false", lambda b: b.op("Dropout", [b.act((4, 5)), b.const(0.3, F), b.const(False, np.bool_)],
                                              num_outputs=2)[0]),
    # torch's scaled_dot_product_attention in a dynamo optimize=False export: the scale computed from a shape and
    # cast like the query, so a trained tensor feeds CastLike's type input.
    Case("castlike_scale", _castlike(lambda b, q: b.const(3))),
    Case("castlike_value", _castlike(lambda b, q: b.op("Cast", [b.act((4, 5))], to=11))),
    Case("cast_double_roundtrip", lambda b: b.op("Cast", [b.op("Cast", [b.act((4, 5))], to=11)], to=1)),
    Case("sum3", lambda b: b.op("Sum", [b.act((4, 5)), b.param((5,)), b.act((4, 5))])),
    Case("topk_values", lambda b: b.op("TopK", [b.act((4, 6)), b.const([3])], num_outputs=2, axis=-1)[0]),
    Case("trilu_lower", lambda b: b.op("Trilu", [b.act((4, 3, 3)), b.const(0)], upper=0)),
    Case("scatter_nd", lambda b: b.op("ScatterND", [b.act((4, 5)), b.const([[1], [3]]), b.param((2, 5))])),
    Case("identity", _unary("Identity")),
]

CASES_20: list[Case] = [
    Case("gelu_erf_op20", lambda b: b.op("Gelu", [b.act((4, 5), 2.0)]), 20),
    Case("gelu_tanh_op20", lambda b: b.op("Gelu", [b.act((4, 5), 2.0)], approximate="tanh"), 20),
    Case("reduce_mean_axes_input_keep0", _reduce("ReduceMean", [1], 0), 18),
    Case("reduce_mean_axes_input_keep1", _reduce("ReduceMean", [-1, 1], 1), 18),
    Case("reduce_mean_noop", _reduce("ReduceMean", None, 1, noop=1), 18),
    Case("reduce_mean_all_op18", _reduce("ReduceMean", None, 0), 18),
    Case("reduce_l2_axes_input", _reduce("ReduceL2", [1], 1, positive=True), 18),
    Case("pad_axes_input", _pad("constant", [1, 2], axes=[-1]), 18),
    _resize("linear", 19, coordinate_transformation_mode="half_pixel", antialias=0),
]
