"""torch's recurrent layers in a program: nn.LSTM's fused layer run as eager
runs it, and those the program cannot compute as eager does refused while the
step is traced.

On CPU, eager's nn.LSTM runs oneDNN's fused layer (mkldnn_rnn_layer), whose
backward reads a workspace its forward returns, but only when grad mode is on;
a program runs with grad mode off (ambient.as_traced). The trace records the
layer as `transpiler::mkldnn_rnn_layer` (`LSTM_LAYERS`), the same kernel
called with grad mode on. Its backward kernel reads its input as if it were
contiguous: given the transposed input a compiler may lay out (inductor did,
for a batch-first LSTM), it computes the input weights' gradient wrong (torch
2.13). The trace records it as `transpiler::mkldnn_rnn_layer_backward`, which
gives the kernel a contiguous input (as eager's always is). On other devices
nn.LSTM runs another kernel (cuDNN's), not tested here, and is refused.

nn.GRU and nn.GRUCell run torch's composite cell, which computes its gates in
place on strided views of one matrix; the program computes them out of place
on contiguous tensors, and sigmoid and tanh round an element of a vectorized
loop's tail otherwise than one of its body, so the program would differ from
eager by about 1e-8 (nn.RNN, nn.RNNCell and nn.LSTMCell compute alike and are
not refused). Until the program computes them as eager does, calling one in
the step raises a TranspileError at the user's line, at the first call,
before anything runs. So does packing a batch of sequences by their lengths
(pack_padded_sequence, pack_sequence), whose sizes a trace cannot follow.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import TranspileError
from .user_code import user_line

_LAYER = ("not supported in a transpiled step yet (nn.RNN, nn.RNNCell, nn.LSTMCell, and "
          "nn.LSTM on the CPU, are); train it with torch DDP")
# torch._VF's functions the layers call -> why each is refused, and what to do
_REFUSED = {
    "gru": ("nn.GRU computes its gates in place on strided views, which the program computes "
            "out of place and rounds otherwise (about 1e-8 off eager)", _LAYER),
    "gru_cell": ("nn.GRUCell computes its gates in place on strided views, which the program "
                 "computes out of place and rounds otherwise (about 1e-8 off eager)", _LAYER),
    "_pack_padded_sequence": (
        "pack_padded_sequence sizes every step of the recurrent layer by the batch's lengths, "
        "read on the host", "a static program cannot take them from each call's lengths; pad "
        "the batch to one length and mask the padded steps (or the loss) instead"),
}


def _refusing(name: str):
    def refuse(*args, **kwargs):
        why, instead = _REFUSED[name]
        raise TranspileError(f"{why}{user_line(None)}: {instead}")
    return refuse


def _lstm_on_cpu_only(input, *args, **kwargs):
    if input.device.type != "cpu":
        raise TranspileError(
            f"nn.LSTM on {input.device.type} runs a kernel whose program is not tested"
            f"{user_line(None)}: {_LAYER}")
    return _VF_LSTM(input, *args, **kwargs)


_VF_LSTM = torch._VF.lstm


@contextlib.contextmanager
def recurrent_layers_refused():
    vf = torch._VF   # a module object whose attributes fall back to torch's C functions
    for name in _REFUSED:
        setattr(vf, name, _refusing(name))
    vf.lstm = _lstm_on_cpu_only
    try:
        yield
    finally:
        for name in (*_REFUSED, "lstm"):
            delattr(vf, name)


_ATEN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
_ATEN_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default
Tensors7 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor]


@torch.library.custom_op("transpiler::mkldnn_rnn_layer", mutates_args=())
def _mkldnn_rnn_layer(input: torch.Tensor, weight0: torch.Tensor, weight1: torch.Tensor,
                      weight2: torch.Tensor, weight3: torch.Tensor, hx: torch.Tensor,
                      cx: torch.Tensor, reverse: bool, batch_sizes: list[int], mode: int,
                      hidden_size: int, num_layers: int, has_biases: bool, bidirectional: bool,
                      batch_first: bool, train: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():   # no input requires grad here: nothing is recorded
        return _ATEN_LAYER(input, weight0, weight1, weight2, weight3, hx, cx, reverse,
                           batch_sizes, mode, hidden_size, num_layers, has_biases,
                           bidirectional, batch_first, train)


@_mkldnn_rnn_layer.register_fake
def _(*args):
    with torch.enable_grad():
        return _ATEN_LAYER(*args)


@torch.library.custom_op("transpiler::mkldnn_rnn_layer_backward", mutates_args=())
def _mkldnn_rnn_layer_backward(
        input: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
        weight3: torch.Tensor, weight4: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor,
        output: torch.Tensor, hy: torch.Tensor, cy: torch.Tensor,
        grad_output: torch.Tensor | None, grad_hy: torch.Tensor | None,
        grad_cy: torch.Tensor | None, reverse: bool, mode: int, hidden_size: int,
        num_layers: int, has_biases: bool, train: bool, bidirectional: bool,
        batch_sizes: list[int], batch_first: bool, workspace: torch.Tensor) -> Tensors7:
    return _ATEN_LAYER_BACKWARD(input.contiguous(), weight1, weight2, weight3, weight4, hx, cx,
                                output, hy, cy, grad_output, grad_hy, grad_cy, reverse, mode,
                                hidden_size, num_layers, has_biases, train, bidirectional,
                                batch_sizes, batch_first, workspace)


@_mkldnn_rnn_layer_backward.register_fake
def _(*args):
    return _ATEN_LAYER_BACKWARD(*args)


# Decompositions for the trace: oneDNN's LSTM layer and its backward as the
# custom ops above (see the module's docstring)
LSTM_LAYERS = {
    _ATEN_LAYER: torch.ops.transpiler.mkldnn_rnn_layer.default,
    _ATEN_LAYER_BACKWARD: torch.ops.transpiler.mkldnn_rnn_layer_backward.default,
}
