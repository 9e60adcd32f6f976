"""The eager backend's reinplacing: state updated in place, never before the
backward pass and every collective are done."""

import copy

import pytest
import torch

from tests import models as M
from tests.test_decentralized import ring_context
from tests.test_passes import CTX, _captured
from transpiler import run_passes, transpile

from transpiler.modes import MODES
from transpiler.program import InputKind, OutputKind
from transpiler.reinplace import _VIEWS, reinplace
from transpiler.roles import Role


PROGRAMS = [(mode, name, passes) for mode, programs in sorted(MODES.items())
            for name, passes in (programs.items() if isinstance(programs, dict)
                                 else [("main", programs)])]


@pytest.mark.parametrize("mode,name,passes", PROGRAMS, ids=[f"{m}-{n}" for m, n, _ in PROGRAMS])
def test_state_is_written_only_after_gradients_and_communication(mode, name, passes):
    program = _captured("tied").program
    run_passes(program, passes, ring_context(CTX) if mode == "decentralized" else CTX)
    gm, written = reinplace(program)
    nodes = list(gm.graph.nodes)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    last = max(i for i, n in enumerate(nodes)
               if n.op == "call_function" and n.meta["role"] & (Role.BACKWARD | Role.COMM))
    mutations = [i for i, n in enumerate(nodes) if _mutates(n)
                 and any(_base(a) in placeholders for a in torch.utils._pytree.tree_leaves(n.args[:1]))]
    assert mutations, "the optimizer's updates should run in place"
    assert min(mutations) > last
    if mode == "zero":
        # The all-gathers read the updated shards, so the last collective ends
        # after the update: the state shards are written back by the runtime,
        # and each parameter straight from its gathered rows.
        in_place = {spec.target: w for w, spec in zip(written, program.outputs)
                    if spec.kind is OutputKind.UPDATE}
        kinds = {spec.name: spec.kind for spec in program.inputs}
        assert in_place and all(w == (kinds[t] is InputKind.PARAM) for t, w in in_place.items())
        return
    # Every state update was done in place: no write-back copies remain. In
    # local SGD's sync program the optimizer's update feeds the collective, so
    # only the averaged parameters, computed in their snapshots, are in place.
    kinds = {spec.name: spec.kind for spec in program.inputs}
    in_place = {spec.target: w for w, spec in zip(written, program.outputs) if spec.kind is OutputKind.UPDATE}
    if name == "sync":
        in_place = {t: w for t, w in in_place.items() if kinds[t] is InputKind.HELD}
        assert len(in_place) == len(program.grads)
    assert all(in_place.values())


def _base(node):
    """The tensor a chain of views reads."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _mutates(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def test_functional_program_is_left_functional():
    program = _captured().program
    before = program.listing()
    reinplace(program)
    assert program.listing() == before


def test_error_inside_the_program_leaves_state_untouched():
    model = M.make("tied")
    opt = M.make_optimizer("adamw", model)
    step = transpile(M.lm_step)
    tokens, targets = M.batches("tied", 1, 4)[0]
    for _ in range(2):  # steady state: the in-place program
        step(model, opt, tokens, targets)
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    bad = tokens.clone()
    bad[0, 0] = 1000  # out of the embedding's range: fails in the forward pass
    with pytest.raises(IndexError):
        step(model, opt, bad, targets)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before[0].items())
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, after[p][k]) for p, st in before[1]["state"].items() for k, v in st.items())
