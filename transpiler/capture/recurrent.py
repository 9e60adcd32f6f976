"""torch's recurrent layers that the program cannot compute as eager does,
refused while the step is traced.

On CPU, eager's nn.LSTM runs oneDNN's fused layer (mkldnn_rnn_layer), whose
backward reads a workspace its forward returns and a trace does not carry.
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

_LAYER = ("not supported in a transpiled step yet (nn.RNN, nn.RNNCell and nn.LSTMCell are); "
          "train it with torch DDP")
# torch._VF's functions the layers call -> why each is refused, and what to do
_REFUSED = {
    "lstm": ("nn.LSTM runs oneDNN's fused layer on CPU, whose backward reads a workspace the "
             "program does not carry", _LAYER),
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


@contextlib.contextmanager
def recurrent_layers_refused():
    vf = torch._VF   # a module object whose attributes fall back to torch's C functions
    for name in _REFUSED:
        setattr(vf, name, _refusing(name))
    try:
        yield
    finally:
        for name in _REFUSED:
            delattr(vf, name)
