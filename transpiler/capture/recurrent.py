"""torch's recurrent layers while the step is traced: each recorded in a form
the program computes as eager does, or refused at the user's line.

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
place on strided views of one matrix. Traced op by op, the program would
compute them out of place on contiguous tensors, and sigmoid and tanh round an
element of a vectorized loop's tail otherwise than one of its body (about 1e-8
off eager, forward and backward). The trace records each GRU layer (and each
GRUCell call) as `transpiler::gru`, torch's composite run as eager runs it,
and its backward as `transpiler::gru_backward`: the composite run again with
autograd on, differentiated as eager's engine differentiates it (the forward's
cost again, for eager's bits). Eager's engine accumulates a layer's parameter
gradients one by one as its composite's nodes finish (b_hh, w_hh, b_ih, w_ih),
the trace's all at once as one node's outputs: each call's eager order is
recorded (`ready_orders`), read off the composite run on a few numbers, and
the trace takes it (DDP's reducer builds its buckets by it, and on three ranks
or more a bucket's layout decides how each sum is rounded). The dropout between
a stack's layers stays in the program, drawn as eager draws it. nn.RNN, nn.RNNCell and nn.LSTMCell
compute alike op by op and are traced as they are.

Packing a batch of sequences by their lengths (pack_padded_sequence,
pack_sequence), whose sizes a trace cannot follow, raises a TranspileError at
the user's line, at the first call, before anything runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import TranspileError
from .user_code import user_line

_LAYER = ("not supported in a transpiled step yet (torch's recurrent layers on the CPU are); "
          "train it with torch DDP")
# torch._VF's functions the layers call -> why each is refused, and what to do
_REFUSED = {
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


def _check_on_cpu(layer: str, input: torch.Tensor) -> None:
    if input.device.type != "cpu":
        raise TranspileError(f"{layer} on {input.device.type} runs a kernel whose program is "
                             f"not tested{user_line(None)}: {_LAYER}")


def _lstm_on_cpu_only(input, *args, **kwargs):
    _check_on_cpu("nn.LSTM", input)
    return _VF_LSTM(input, *args, **kwargs)


def _check_gru(layer: str, input: torch.Tensor) -> None:
    """`transpiler::gru` runs the composite on the CPU, autocast off."""
    _check_on_cpu(layer, input)
    if torch.is_autocast_enabled("cpu"):
        raise TranspileError(
            f"{layer} under autocast: its program runs the layer with autocast off, where "
            f"eager casts its matrix products{user_line(None)}: run the layer outside the "
            "autocast region, or train the model with torch DDP")


def _gru(input, hx, params, *args):
    """torch._VF.gru, each layer as `transpiler::gru`; the dropout between
    the layers as at::native::gru draws it."""
    if not isinstance(params, (list, tuple)):   # (data, batch_sizes, hx, params, ...): packed
        raise TranspileError(f"nn.GRU on a packed batch{user_line(None)}: "
                             f"{_REFUSED['_pack_padded_sequence'][1]}")
    _check_gru("nn.GRU", input)
    has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if batch_first:
        input = input.transpose(0, 1)
    directions = 2 if bidirectional else 1
    per_layer = (4 if has_biases else 2) * directions
    finals = []
    for layer in range(num_layers):
        tensors = [input, hx[layer * directions:(layer + 1) * directions],
                   *params[layer * per_layer:(layer + 1) * per_layer]]
        input, final = torch.ops.transpiler.gru(tensors, _needed(tensors), False, has_biases,
                                                bidirectional)
        finals.append(final)
        if dropout and train and layer < num_layers - 1:
            input = torch.dropout(input, dropout, True)
    return input.transpose(0, 1) if batch_first else input, torch.cat(finals)


def _gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch._VF.gru_cell as `transpiler::gru`."""
    _check_gru("nn.GRUCell", input)
    tensors = [input, hx, w_ih, w_hh, *([b_ih, b_hh] if b_ih is not None else [])]
    return torch.ops.transpiler.gru(tensors, _needed(tensors), True, b_ih is not None, False)[0]


def _needed(tensors: list[torch.Tensor]) -> list[bool]:
    return [t.requires_grad for t in tensors]


_VF_LSTM = torch._VF.lstm
_TRACED = {"lstm": _lstm_on_cpu_only, "gru": _gru, "gru_cell": _gru_cell}


# While a step is traced: for each `transpiler::gru` call's backward, the ids
# of its parameters in the order eager's engine accumulates their gradients.
_READY_ORDERS: list[list[list[int]]] = []


@contextlib.contextmanager
def recurrent_layers_traced():
    """While the step is traced; yields the GRU calls' ready orders (a list
    filled as the backward is traced)."""
    vf = torch._VF   # a module object whose attributes fall back to torch's C functions
    for name in _REFUSED:
        setattr(vf, name, _refusing(name))
    for name, traced in _TRACED.items():
        setattr(vf, name, traced)
    orders: list[list[int]] = []
    _READY_ORDERS.append(orders)
    try:
        yield orders
    finally:
        _READY_ORDERS.remove(orders)
        for name in (*_REFUSED, *_TRACED):
            delattr(vf, name)


_ATEN_GRU = torch.ops.aten.gru.input
_ATEN_GRU_CELL = torch.ops.aten.gru_cell.default


def _run_gru(tensors: list[torch.Tensor], cell: bool, has_biases: bool,
             bidirectional: bool) -> list[torch.Tensor]:
    input, hx, *params = tensors   # leaves: which require grad decides the kernels
    if cell:
        return [_ATEN_GRU_CELL(input, hx, *params)]
    return list(_ATEN_GRU(input, hx, params, has_biases, 1, 0.0, True, bidirectional, False))


def _leaves(tensors: list[torch.Tensor], needed: list[bool]) -> list[torch.Tensor]:
    """The tensors as leaves requiring grad where the step's did (`needed`):
    at::native::gru computes other bits when no parameter requires grad (1e-6
    off; a gathered parameter of mode fsdp requires none)."""
    return [t.detach().requires_grad_(need) for t, need in zip(tensors, needed)]


@torch.library.custom_op("transpiler::gru", mutates_args=())
def _gru_op(tensors: list[torch.Tensor], needed: list[bool], cell: bool, has_biases: bool,
            bidirectional: bool) -> list[torch.Tensor]:
    """One GRU layer ([input, hx, *its parameters] -> [output, final
    hidden state]), or one GRUCell call ([input, hx, *parameters] -> [hidden
    state]), as eager computes it (`needed`: which of them require grad)."""
    with torch.no_grad():
        return _run_gru(_leaves(tensors, needed), cell, has_biases, bidirectional)


@_gru_op.register_fake
def _(tensors, needed, cell, has_biases, bidirectional):
    return _run_gru(tensors, cell, has_biases, bidirectional)


def _gru_gradients(tensors: list[torch.Tensor], cell: bool, has_biases: bool,
                   bidirectional: bool, grads: list[torch.Tensor | None],
                   needed: list[bool]) -> list[torch.Tensor]:
    """The gradients of `transpiler::gru` for the inputs `needed` (an empty
    tensor for the others), from those of its outputs (None: unused): the
    forward run again with autograd on and differentiated by the engine, as
    eager's backward pass differentiates it."""
    leaves = _leaves(tensors, needed)
    with _autograd_inside_an_op(), torch.enable_grad():
        outputs = _run_gru(leaves, cell, has_biases, bidirectional)
        used = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in used], wanted, [g for _, g in used],
                                       allow_unused=True, materialize_grads=True))
    return [next(got).contiguous() if need else t.new_empty(0)
            for t, need in zip(tensors, needed)]


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradCPU,
                  torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def _autograd_inside_an_op():
    """A custom op's kernel runs below autograd (its dispatch keys excluded):
    they are let in again for the kernel's own differentiation."""
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    for key in _AUTOGRAD_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, was in zip(_AUTOGRAD_KEYS, excluded):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


_gru_backward_op = torch.library.custom_op("transpiler::gru_backward", _gru_gradients,
                                           mutates_args=())


@_gru_backward_op.register_fake
def _(tensors, cell, has_biases, bidirectional, grads, needed):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else t.new_empty(0)
            for t, need in zip(tensors, needed)]


def _gru_setup(ctx, inputs, output):
    tensors, needed, cell, has_biases, bidirectional = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = cell, has_biases, bidirectional
    ctx.needed = needed
    ctx.ids = [id(t) for t in tensors]
    ctx.steps = 1 if cell else tensors[0].shape[0]
    ctx.set_materialize_grads(False)   # an unused output gets no gradient, as in eager


def _gru_backward(ctx, grads):
    if _READY_ORDERS:
        order = _eager_ready_order(*ctx.options, tuple(ctx.needed),
                                   tuple(g is not None for g in grads), min(ctx.steps, 2))
        _READY_ORDERS[-1].append([ctx.ids[i] for i in order])
    got = torch.ops.transpiler.gru_backward(list(ctx.saved_tensors), *ctx.options, list(grads),
                                            ctx.needed)
    return [g if need else None for g, need in zip(got, ctx.needed)], None, None, None, None


@functools.lru_cache(maxsize=None)
def _eager_ready_order(cell: bool, has_biases: bool, bidirectional: bool, needed: tuple,
                       used: tuple, steps: int) -> tuple[int, ...]:
    """The positions of a GRU call's tensors ([input, hx, *parameters]) that
    need a gradient, in the order eager's engine accumulates them: the
    composite run on one-number tensors of the same structure (its order
    depends on which outputs get a gradient and which inputs need one, not on
    the sizes)."""
    with _disable_current_modes(), torch.enable_grad():   # outside the trace
        return _ready_order(cell, has_biases, bidirectional, needed, used, steps)


def _ready_order(cell, has_biases, bidirectional, needed, used, steps) -> tuple[int, ...]:
    directions = 2 if bidirectional else 1
    if cell:
        shapes = [(1, 1), (1, 1)]
    else:
        shapes = [(steps, 1, 1), (directions, 1, 1)]
    per_direction = [(3, 1), (3, 1)] + ([(3,), (3,)] if has_biases else [])
    shapes += per_direction * (1 if cell else directions)
    leaves = [torch.ones(shape, requires_grad=need) for shape, need in zip(shapes, needed)]
    order: list[int] = []
    for i, t in enumerate(leaves):
        if t.requires_grad:
            t.register_post_accumulate_grad_hook(functools.partial(_append_index, order, i))
    outputs = _run_gru(leaves, cell, has_biases, bidirectional)
    torch.autograd.backward([o for o, u in zip(outputs, used) if u],
                            [torch.ones_like(o) for o, u in zip(outputs, used) if u])
    return tuple(order)


def _append_index(order: list[int], index: int, _tensor) -> None:
    order.append(index)


_gru_op.register_autograd(_gru_backward, setup_context=_gru_setup)


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
