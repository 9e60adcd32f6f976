"""The program's graph as a compiler gets it (transpiler/backends/compiler_graph.py):
reshapes that split and merge dimensions at once go in two steps, so that
inductor's kernels index a symbolic batch as it indexes a static one."""

from __future__ import annotations

import re

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests import models as M
from tests.test_symbolic_shapes import SHAPES, make_lm, tokens
from transpiler.backends import compiler_graph
from transpiler import transpile

B, S = sympy.symbols("B S", integer=True, positive=True)
RESHAPE = torch.ops.aten.reshape.default


@pytest.mark.parametrize("source, target, finest", [
    ([S, B, 128], [S, 4 * B, 32], [S, B, 4, 32]),     # heads split off the features
    ([S, 4 * B, 32], [S, B, 128], [S, B, 4, 32]),     # and merged back
    ([S * B, 384], [S, B, 3, 128], [S, B, 3, 128]),   # only splits: the target itself
    ([S, B, 3, 128], [S * B, 384], [S, B, 3, 128]),   # only merges: the source itself
    ([24, 32], [6, 128], [6, 4, 32]),
    ([6, 4], [4, 6], None),
    ([S, B], [B, S], None),                           # equal products that do not nest
])
def test_finest_common_shape(source, target, finest):
    as_sizes = lambda shape: [sympy.sympify(s) for s in shape]   # noqa: E731
    assert compiler_graph._finest_common(as_sizes(source), as_sizes(target)) == finest


def heads(x):
    """(S, B, 128) -> (S, 4*B, 32) -> (4*B, S, 32) -> back: attention's heads."""
    s, b, _ = x.shape
    h = (x * 2).reshape(s, 4 * b, 32).transpose(0, 1).contiguous()
    return h.transpose(0, 1).reshape(s, b, 128).sin()


def test_reshape_in_steps_computes_the_same_values_and_adds_no_guard():
    gm = make_fx(heads, tracing_mode="symbolic")(torch.randn(5, 3, 128))
    x = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    shape_env = x.fake_mode.shape_env
    guards = len(shape_env.guards)
    compiler_graph.views_as_reshapes(gm.graph)
    compiler_graph.reshapes_in_steps(gm.graph)
    gm.recompile()
    assert len(shape_env.guards) == guards
    steps = [[str(s) for s in n.meta["val"].shape] for n in gm.graph.nodes if n.target is RESHAPE]
    s, b = map(str, x.shape[:2])
    assert steps == [[s, b, "4", "32"], [s, f"4*{b}", "32"], [s, b, "4", "32"], [s, b, "128"]]
    for shape in [(5, 3, 128), (7, 2, 128), (1, 9, 128)]:
        x = torch.randn(shape)
        assert torch.equal(gm(x), heads(x))


def _unvectorized_kernels() -> tuple[int, list[str]]:
    """Inductor's kernels for the LM's symbolic program (dynamic=True), from a
    cold cache: how many, and the names of those that do not use at::vec (one
    element per loop iteration)."""
    from torch._inductor.utils import fresh_cache, run_and_get_code
    model = make_lm(layers=1)   # the compile is cold: one layer has every kernel kind
    opt = M.make_optimizer("sgd", model)
    step = transpile(M.lm_step, backend="inductor", dynamic=True)
    with fresh_cache():
        _, code = run_and_get_code(step, model, opt, *tokens(*SHAPES[0], seed=0))
    kernels = KERNEL.findall("\n".join(code))
    return len(kernels), [name for name, body in kernels if "at::vec::" not in body]


# A C++ kernel of inductor's generated module: its name and its source.
KERNEL = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\((.*?)^\'\'\'\)",
                    re.M | re.S)


@pytest.mark.compiles
def test_symbolic_attention_kernels_are_vectorized():
    """Every kernel of the LM's symbolic program is vectorized, as the static
    program's are. Without reshapes_in_steps (backends/compile.py), the
    kernel that reads attention's gradients through the mixed reshape
    (select_backward's) was not; a second cold compile without it took as
    long as this test, and the rewrite's own tests above check its graphs."""
    count, scalar = _unvectorized_kernels()
    assert count > 10 and scalar == []


def regroup(x):
    """(B, S, 6) -> (B*S, 6) -> (B, 3*S, 2): the finest common shape of the
    second reshape, (B, S, 3, 2), needs S, which neither of its shapes holds."""
    b, s, _ = x.shape
    return x.reshape(b * s, 6).sin().reshape(b, 3 * s, 2)


def test_reshape_left_whole_where_a_size_has_no_node():
    gm = make_fx(regroup, tracing_mode="symbolic")(torch.randn(4, 5, 6))
    compiler_graph.views_as_reshapes(gm.graph)
    before = [n.format_node() for n in gm.graph.nodes]
    compiler_graph.reshapes_in_steps(gm.graph)
    assert [n.format_node() for n in gm.graph.nodes] == before


def _unscale(grads, found_inf, inv_scale):
    """GradScaler.unscale_'s kernel, functional, as a program holds it."""
    unscaled, found = torch.ops.aten._amp_foreach_non_finite_check_and_unscale(
        grads, found_inf, inv_scale)
    return *unscaled, found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_unscale_as_math_computes_the_kernels_bits(dtype, bad):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, generator=g).to(dtype) * 1000, torch.randn(3, 5, generator=g).to(dtype),
             torch.randn(1, generator=g).to(dtype)]
    if bad is not None:
        grads[1][1, 2] = bad
    args = (grads, torch.zeros(()), torch.tensor(1 / 3))
    gm = make_fx(_unscale, tracing_mode="fake")(*args)
    expected = gm(*args)
    compiler_graph.unscales_as_math(gm.graph)
    gm.recompile()
    assert not any(n.target is torch.ops.aten._amp_foreach_non_finite_check_and_unscale.default
                   for n in gm.graph.nodes)
    got = gm(*args)
    assert got[-1].item() == (0.0 if bad is None else 1.0) == expected[-1].item()
    for e, x in zip(expected[:-1], got[:-1]):
        assert x.dtype == e.dtype and x.shape == e.shape
        # Bit for bit; a NaN's payload aside (the step that read it is skipped).
        assert torch.equal(e.isnan(), x.isnan())
        assert torch.equal(e.nan_to_num().view(-1).view(torch.uint8),
                           x.nan_to_num().view(-1).view(torch.uint8))


class PickedKey(torch.nn.Module):
    """Falcon's multi-query attention in small: the key picked from a fused
    projection with a one-element index list and read transposed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.x = torch.nn.Parameter(torch.randn(2, 8, 4, 8))
        self.register_buffer("q", torch.randn(2, 2, 8, 8))
        self.register_buffer("r", torch.randn(2, 2, 8, 8))

    def forward(self):
        k = self.x[..., [2], :].transpose(1, 2).reshape(2, 1, 8, 8)
        return ((self.q @ k.transpose(-1, -2)) * self.r).sum()


def picked_key_step(model, opt):
    opt.zero_grad()
    loss = model()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.compiles
def test_scatter_of_an_index_gradient_runs_as_atens_kernel():
    """On two threads inductor's own kernel wrote x's gradient into the wrong
    slots (13.7 off) and past the buffer (compiler_graph.scatters_as_kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, theirs = PickedKey(), PickedKey()
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ours, theirs)]
        step = transpile(picked_key_step, backend="inductor")
        for _ in range(3):
            step(ours, opts[0])
            picked_key_step(theirs, opts[1])
            torch.testing.assert_close(ours.x.grad, theirs.x.grad, rtol=1e-5, atol=1e-5)
        assert step.compiles == 1
    finally:
        torch.set_num_threads(threads)
