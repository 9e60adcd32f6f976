"""Decisions on tensor values (capture/decisions.py): Python control flow on
what a tensor holds traces on this call's values, is checked as the program
runs, and a call that decides otherwise runs the program of its own decisions,
with nothing written by the one that failed its check: bit for bit as eager,
and on 2 ranks as DDP with its defaults. MoE layers written the ways public
code routes tokens (a loop over nonzero() rows, an expert skipped when no
token reaches it, sizes from .tolist()) are the main users."""

import copy

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import models as M
from transpiler import transpile
from transpiler.errors import TranspileError


class Branchy(nn.Module):
    """Takes one of two losses by a decision on its input's value, made after a
    dropout has drawn (a run that fails its check has drawn too)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = nn.functional.dropout(self.fc(x), 0.3)
        if x.mean() > 0:
            return y.pow(2).mean() * 2
        return y.abs().mean()


class MoE(nn.Module):
    """Top-2 of 4 experts, routed as `route` says (each as in public MoE code)."""

    def __init__(self, route, d=8, experts=4):
        super().__init__()
        self.route, self.k = route, 2
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        top, idx = self.gate(x).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(x)
        if self.route == "skip_empty":   # an expert no token reaches is skipped
            for i, expert in enumerate(self.experts):
                tok, slot = torch.where(idx == i)
                if tok.numel() == 0:
                    continue
                out.index_add_(0, tok, expert(x[tok]) * top[tok, slot, None])
        elif self.route == "hit_experts":   # a loop over the experts hit (nonzero rows)
            mask = nn.functional.one_hot(idx, len(self.experts)).permute(2, 1, 0)
            for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
                slot, tok = torch.where(mask[e[0]])
                out.index_add_(0, tok, self.experts[e[0]](x[tok]) * top[tok, slot, None])
        else:   # "split_sizes": tokens sorted by expert, split by counts from .tolist()
            order = idx.flatten().argsort(stable=True)
            counts = torch.bincount(idx.flatten(), minlength=len(self.experts)).tolist()
            xs = x.repeat_interleave(self.k, 0)[order]
            ys = torch.cat([e(c) for e, c in zip(self.experts, xs.split(counts))])
            y = torch.empty_like(ys).index_copy(0, order, ys) * top.flatten()[:, None]
            out = y.view(-1, self.k, x.shape[-1]).sum(1)
        return out.pow(2).mean()


def step(model, opt, x):
    opt.zero_grad()
    loss = model(x)
    loss.backward()
    opt.step()
    return loss.detach()


def _batches(n, skew_every=3):
    """Batches whose decisions change: every `skew_every`-th one shifted."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) * (4 if i % skew_every == 0 else 1)
            for i in range(n)]


def _against_eager(model, batches, backend="eager", step_fn=step):
    ours, theirs = model, copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    transpiled = transpile(step_fn, backend=backend)
    for i, x in enumerate(batches):
        torch.manual_seed(i)
        a = transpiled(ours, opts[0], x)
        torch.manual_seed(i)
        e = step_fn(theirs, opts[1], x)
        if backend == "eager":
            assert torch.equal(a, e), f"call {i}: {a} != {e}"
    return transpiled, M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1]))


def test_a_decision_that_changes_runs_the_program_of_its_branch():
    torch.manual_seed(0)
    model = Branchy()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 4, generator=g) + (3 if i % 3 == 0 else -3) for i in range(8)]
    transpiled, error = _against_eager(model, batches)
    assert error == 0.0
    # both branches taken; each traced once, then found again by its check
    assert transpiled.traces == 2


@pytest.mark.parametrize("route", ["skip_empty", "hit_experts", "split_sizes"])
def test_moe_routing_on_tensor_values_equals_eager(route):
    torch.manual_seed(0)
    model = MoE(route)
    # a 4-token batch often leaves an expert without tokens: skip_empty's decision changes
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    _, error = _against_eager(model, batches)
    assert error == 0.0


@pytest.mark.compiles
@pytest.mark.parametrize("model", ["branchy", "skip_empty", "hit_experts"])
def test_decisions_under_inductor_within_1e_5(model):
    """inductor knows what the trace assumed of a decision's value (a range
    of [1, 1] for a bool that was True): a check computed from that value
    would be folded into a constant and pass whatever the call holds. Each
    check reads its numbers itself: both branches are taken, each traced once.
    hit_experts loops over nonzero()'s rows, whose number the loop fixes:
    inductor asserted that size where nonzero returns, before the check ran,
    and a call that hit another number of experts failed with its assertion
    (backends/checks_on_failure.py)."""
    torch.manual_seed(0)
    if model == "branchy":
        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(2, 4, generator=g) + (3 if i % 3 == 0 else -3) for i in range(5)]
        transpiled, error = _against_eager(Branchy(), batches, backend="inductor")
    else:   # 4 tokens: an expert without tokens at some calls, not at others
        batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
        transpiled, error = _against_eager(MoE(model), batches, backend="inductor")
    assert transpiled.traces >= 2
    assert error < 1e-5


def test_a_program_that_fails_its_check_writes_nothing():
    """The check fails mid-run (after the forward's first ops): parameters and
    optimizer state are those of eager at every call, not half-updated."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    transpiled = transpile(step)
    x = torch.full((2, 4), 3.0)
    transpiled(model, opt, x)   # traced where the first branch is taken
    before = {n: p.clone() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    x = torch.full((2, 4), -3.0)
    torch.manual_seed(5)
    transpiled(model, opt, x)
    torch.manual_seed(5)
    step(reference, ref_opt, x)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert not torch.equal(p, before[n]) and torch.equal(p, q), n


def _decide_after_reduction(model, opt, x):
    opt.zero_grad()
    model(x).backward()
    if model.fc.weight.grad.norm() > 1e6:   # after DDP's all-reduce
        return torch.zeros(())
    opt.step()
    return torch.ones(())


def _rank_decisions_vs_ddp(backend="eager"):
    rank = dist.get_rank()

    def train(step_fn, wrap):
        torch.manual_seed(0)
        model = Branchy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        net = wrap(model)
        g = torch.Generator().manual_seed(rank)
        for i in range(6):   # the ranks decide apart, and otherwise from call to call
            x = torch.randn(2, 4, generator=g) + (3 if (i + rank) % 3 == 0 else -3)
            torch.manual_seed(10 * i + rank)
            step_fn(net, opt, x)
        return M.state_of(model, opt)

    return M.max_rel_error(train(transpile(step, backend=backend), lambda m: m), train(step, DDP))


def _rank_refuses_decision_after_collective():
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(TranspileError, match="after program 'main' has issued a collective"):
        transpile(_decide_after_reduction)(model, opt, torch.randn(2, 4))
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.slow
def test_decisions_on_2_ranks_equal_ddp(ranks2):
    assert ranks2.run(_rank_decisions_vs_ddp) == [0.0, 0.0]


@pytest.mark.slow
def test_decisions_on_2_ranks_under_inductor_within_1e_5_of_ddp(ranks2):
    assert all(e < 1e-5 for e in ranks2.run(_rank_decisions_vs_ddp, "inductor"))


@pytest.mark.slow
def test_a_decision_after_the_first_collective_is_refused_on_every_rank(ranks2):
    assert ranks2.run(_rank_refuses_decision_after_collective) == [True, True]


def test_a_decision_after_the_backward_is_taken_in_one_process():
    torch.manual_seed(0)
    model = Branchy()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 4, generator=g) for _ in range(3)]
    _, error = _against_eager(model, batches, step_fn=_decide_after_reduction)
    assert error == 0.0


class _CountedNorm(nn.BatchNorm1d):
    """torch's own SyncBatchNorm with momentum=None, in one process: a
    cumulative average whose factor is 1.0 / num_batches_tracked.item(), a
    number the op takes as a constant, not a branch."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.item()
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                        self.bias, True, factor, self.eps)


def test_a_number_computed_from_a_tensor_value_is_checked_as_a_decision():
    """torch cannot put `1.0 / u0 == 1.0` into a graph as a check: without one,
    the program kept the first call's factor (the running mean 0.2 off eager's
    at the second call). It is pinned to its value instead, and traced again
    when it changes."""
    def build():
        return nn.Sequential(nn.Linear(16, 6), _CountedNorm(6, momentum=None), nn.Linear(6, 4))
    step = M.against_eager(M.classify_step, build=build)
    assert step.traces == 4


class _Speech(nn.Module):
    """A CTC head as transformers' wav2vec2 computes its loss: log-probs over
    time, the labels' non-padding tokens concatenated (masked_select), the
    lengths as tensors."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 6)

    def forward(self, x):
        return self.proj(x).log_softmax(-1).transpose(0, 1)   # (T, B, C)


def _ctc_step(model, opt, x, labels):
    opt.zero_grad()
    mask = labels > 0
    loss = nn.functional.ctc_loss(model(x), labels.masked_select(mask),
                                  torch.full((x.shape[0],), x.shape[1]), mask.sum(-1))
    loss.backward()
    opt.step()
    return loss


def _ctc_against_eager(backend: str, label_lengths: list) -> tuple:
    """_ctc_step transpiled and eager, one call per pair of label lengths;
    the transpiled step and the states' largest relative difference."""
    torch.manual_seed(0)
    ours = _Speech()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(_ctc_step, backend=backend)
    g = torch.Generator().manual_seed(0)
    for lengths in label_lengths:
        x = torch.randn(2, 10, 16, generator=g)
        labels = torch.zeros(2, 4, dtype=torch.long)
        for row, n in enumerate(lengths):
            labels[row, :n] = torch.randint(1, 6, (n,), generator=g)
        a, e = step(ours, opts[0], x, labels), _ctc_step(theirs, opts[1], x, labels)
        if backend == "eager":
            assert torch.equal(a, e)
    return step, M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1]))


def test_ctc_loss_with_lengths_as_tensors_equals_eager():
    """F.ctc_loss's saved alphas are sized by the target lengths' values: read
    as lists (a decision), as its CPU kernel reads them; another set of
    lengths traces again."""
    step, error = _ctc_against_eager("eager", [[3, 2], [3, 2], [1, 4]])
    assert error == 0.0
    assert step.traces == 2


def _ctc_list_step(reduction: str):
    def step(model, opt, x, labels):
        opt.zero_grad()
        loss = nn.CTCLoss(reduction=reduction, zero_infinity=True)(
            model(x), labels, [x.shape[1]] * x.shape[0], (3, 2))
        loss.sum().backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_loss_with_lengths_as_lists_equals_eager(reduction):
    """Lengths as Python lists: the kernel makes a tensor of them to average
    by target length, which a fake tensor cannot hold; traced as the tensor
    overload, one program for those lengths."""
    torch.manual_seed(0)
    ours = _Speech()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step_fn = _ctc_list_step(reduction)
    step = transpile(step_fn)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, labels = torch.randn(2, 10, 16, generator=g), torch.randint(1, 6, (2, 3), generator=g)
        assert torch.equal(step(ours, opts[0], x, labels), step_fn(theirs, opts[1], x, labels))
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) == 0.0
    assert step.traces == 1


@pytest.mark.compiles
def test_ctc_loss_under_inductor_as_its_labels_padding_changes():
    """The labels' masked_select is sized by the lengths' values, which
    ctc_loss's decisions fix. inductor was given a fresh shape environment,
    where its own symbol for that size took the trace's name (`u0 possible
    memo disaster`: the program was refused); given the trace's, it compiles.
    Then a call with other lengths (a label padded) failed with inductor's
    assertion of the size, before the program's check: it now runs the
    program of its own lengths, as the eager backend does."""
    step, error = _ctc_against_eager("inductor", [[3, 2], [3, 2], [1, 4], [4, 4], [3, 2]])
    assert step.traces == 3
    assert error < 1e-5


class _Tagger(nn.Module):
    """A loss over the tokens that are not padding, `logits[mask]` (a size no
    decision fixes, symbolic in the program)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x, y):
        keep = y != -100
        return nn.functional.cross_entropy(self.fc(x)[keep], y[keep])


def _tag_step(model, opt, x, y):
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.compiles
def test_a_boolean_mask_under_inductor_is_compiled_once_for_every_count():
    """The program holds the masked size as the trace's symbol; inductor is
    compiled in the trace's shape environment (a fresh one named its own
    symbol as the trace's: refused as a memo disaster), once for every count."""
    torch.manual_seed(0)
    ours = _Tagger()
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    transpiled = transpile(_tag_step, backend="inductor")
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        y = torch.randint(0, 5, (12,), generator=g)
        y[torch.rand(12, generator=g) < 0.3] = -100
        x = torch.randn(12, 8, generator=g)
        transpiled(ours, opts[0], x, y)
        _tag_step(theirs, opts[1], x, y)
    assert transpiled.traces == 1 and transpiled.compiles == 1
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) < 1e-5


def _over_values(step_fn, values):
    """The step transpiled and eager on a Linear from the same start, called
    with each of `values` (a tensor, or a number made one) under the same
    seed: equal outputs and parameters at every call. Returns the transpiled
    step."""
    torch.manual_seed(0)
    ours = nn.Linear(4, 3)
    theirs = copy.deepcopy(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(step_fn)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for i, value in enumerate(values):
        t = torch.as_tensor(value)
        torch.manual_seed(i)
        a = step(ours, opts[0], x, t)
        torch.manual_seed(i)
        assert torch.equal(a, step_fn(theirs, opts[1], x, t)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters())), i
    return step


def _perturbed_step(model, opt, x, eps):
    """A random perturbation within a tensor's value (FGSM's random start):
    uniform_ takes the float, a decision pinned to it."""
    opt.zero_grad()
    delta = torch.empty_like(x).uniform_(-eps.item(), eps.item())
    loss = model(x + delta).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_decision_on_a_float_holds_on_the_call_it_was_traced_on():
    """A float32's 0.1 as a double (0.10000000149011612) was checked as its 15
    digits, 0.100000001490116: the check failed on the very call it was traced
    on, and the step was refused. Each float is checked as the double it is;
    another value traces again, and a value seen before finds its program."""
    values = [torch.tensor(0.1)] * 3 + [torch.tensor(1 / 3, dtype=torch.float64),
                                        torch.tensor(1e-300, dtype=torch.float64),
                                        torch.tensor(0.1)]
    step = _over_values(_perturbed_step, values)
    assert step.traces == 3


@pytest.mark.parametrize("value", [float(torch.tensor(0.1)), -1 / 3, -2.709521821001284e-44,
                                   5e-324, 1.7976931348623157e308, float("-inf")])
def test_a_checked_float_reads_back_as_the_same_double(value):
    """A check's expression travels to the program as text: its floats read
    back bit for bit (-2.709521821001284e-44 is one that sympy's own reading
    of its digits rounds to another double)."""
    from transpiler.capture import decisions
    u = sympy.Symbol("zuf0")
    for expr in (sympy.Eq(u, value), u <= value, u >= value):
        with decisions._exact_floats():
            text = str(expr)
        assert decisions._holds(text, ("zuf0",), (value,)), text


def _float_decision_step(model, opt, x, t):
    """A branch on a float read from a tensor, and a number derived from one
    by max() (ASGD's 1 / max(1, step - t0))."""
    opt.zero_grad()
    scale = 3.0 if t.item() > 3 else 1.0
    floor = max(1, t.item() - 2)
    loss = (model(x) * scale).pow(2).mean() / floor
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_bound_on_a_float_is_checked():
    """torch drops a check `u <= 3.0` on an unbacked float as redundant with a
    range it keeps for integers only: the program held the first call's
    branch silently (decisions._keep_float_bounds)."""
    step = _over_values(_float_decision_step, [1.0, 5.0, 2.5, 6.0, 7.5])
    assert step.traces == 2   # t <= 3 (and t - 2 <= 1): 1.0, 2.5; t > 3 (and t - 2 > 1): the rest


@pytest.mark.parametrize("foreach", [False, True])
def test_asgd_averages_as_eager(foreach):
    """ASGD's mu = 1 / max(1, step - t0), a decision on its step count."""
    runs = []
    for transpiled in (True, False):
        model = M.make("mlp")
        opt = torch.optim.ASGD(model.parameters(), lr=1e-2, t0=2, foreach=foreach)
        fn = transpile(M.classify_step) if transpiled else M.classify_step
        for batch in M.batches("mlp", 5, 8):
            fn(model, opt, *batch)
        runs.append(M.state_of(model, opt))
    M.assert_states_equal(*runs)


def _zero_bound_step(model, opt, x, t):
    """Bounds by zero (a sign, a clamp at 0 in Python), which sympy would fold
    back into a bare bound that torch drops."""
    opt.zero_grad()
    sign = 2.0 if t.item() < 0 else 1.0
    loss = (model(x) * sign).pow(2).mean() + max(t.item(), 0.0)
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_bound_on_a_float_by_zero_is_checked():
    step = _over_values(_zero_bound_step, [1.0, -1.0, 2.0, -3.0, 0.0, -0.0])
    assert step.traces == 2


def _warmup_step(model, opt, x, n):
    """A warmup factor from a step count in a tensor, and a rounded value:
    expressions torch's assert insertion cannot build, pinned instead."""
    opt.zero_grad()
    factor = min(1.0, (n.item() + 1) / 5) * round(n.item() * 0.7)
    loss = (model(x) * factor).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def test_a_decision_torch_cannot_check_is_pinned_to_its_value():
    step = _over_values(_warmup_step, [3, 5, 3, 9])
    assert step.traces == 3   # a program per value: 3, 5, 9


class _RoutedTwiceAfterDropout(nn.Module):
    """Top-1 routing, dropout on its output, routing again into the same sum;
    the first sum built in place (index_add_)."""

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.fc = nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.router = nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(self.a(x))
        top = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e in torch.bincount(top, minlength=4).nonzero():
            idx = torch.where(top == e[0])[0]
            out.index_add_(0, idx, self.experts[e[0]](h[idx]))
        h2 = self.drop(out)
        top2 = self.router(h2).argmax(-1)
        for e in torch.bincount(top2, minlength=4).nonzero():
            idx = torch.where(top2 == e[0])[0]
            out = out.index_add(0, idx, self.experts[e[0]](h2[idx]))
        return self.fc(out)


def test_a_second_routing_on_a_sum_built_in_place_equals_eager():
    """Traced on the call's values, index_add_ added twice into its real twin
    (torch ran the op, then its Python decomposition, on the twins), so the
    second routing decided on other values than the run's and the first call
    was refused (capture/real_twins.py)."""
    torch.manual_seed(0)
    _classifies_as_eager(_RoutedTwiceAfterDropout(), torch.optim.AdamW, calls=3)


def _classifies_as_eager(model, optimizer, calls):
    """M.classify_step transpiled against eager from `model`, `calls` seeded
    calls on (8, 16) batches of 4 classes, bit for bit; the transpiled step."""
    ours, theirs = model, copy.deepcopy(model)
    opts = [optimizer(m.parameters(), lr=0.1) for m in (ours, theirs)]
    step = transpile(M.classify_step)
    g = torch.Generator().manual_seed(0)
    for i in range(calls):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        torch.manual_seed(i)
        a = step(ours, opts[0], x, y)
        torch.manual_seed(i)
        assert torch.equal(a, M.classify_step(theirs, opts[1], x, y)), i
    assert M.max_rel_error(M.state_of(ours, opts[0]), M.state_of(theirs, opts[1])) == 0.0
    return step


_RUNS = [0]


@torch.library.custom_op("transpiler_tests::runs_counted", mutates_args=())
def _runs_counted(x: torch.Tensor) -> torch.Tensor:
    """x plus how many times it has run, mod 2: the trace's real run and the
    program's compute different values."""
    _RUNS[0] += 1
    return x + _RUNS[0] % 2


@_runs_counted.register_fake
def _(x):
    return torch.empty_like(x)


class _DecidesOnACountedValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop, self.fc = nn.Dropout(0.1), nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(x)
        if _runs_counted(torch.zeros(())) > 0.5:
            h = h * 2
        return self.fc(h)


def test_a_first_run_whose_decision_goes_otherwise_is_refused_with_the_generators_put_back():
    """Traced on the call's values, the run decides otherwise (its op computes
    otherwise than the trace's run of it, after a dropout drew): the first
    call is refused, with nothing written and torch's generator as the call
    found it."""
    torch.manual_seed(0)
    model = _DecidesOnACountedValue()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = transpile(M.classify_step)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with pytest.raises(TranspileError, match="went otherwise as it ran"):
        step(model, opt, x, y)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))


def _skip_if_not_finite(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if not torch.isfinite(loss):
        return None
    loss.backward()
    opt.step()
    return loss.detach()


def test_an_early_return_without_backward_trains_as_eager_and_skip_nonfinite_does_too():
    """`if not torch.isfinite(loss): return` before backward(): the call whose
    loss is NaN runs a program of that branch (the forward only, zero_grad's
    None written) and returns None, as eager; skip_nonfinite=True without the
    early return trains as eager with it."""
    def model_and_opt():
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g))
               for _ in range(4)]
    batches[2][0][0, 0] = float("nan")
    eager, eager_opt = model_and_opt()
    model, opt = model_and_opt()
    step = transpile(_skip_if_not_finite)
    for i, batch in enumerate(batches):
        expected = _skip_if_not_finite(eager, eager_opt, *batch)
        got = step(model, opt, *batch)
        assert (got is None) == (expected is None) == (i == 2)
        assert got is None or torch.equal(got, expected)
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.equal(p, q) and (p.grad is None) == (q.grad is None), i
            assert p.grad is None or torch.equal(p.grad, q.grad)
    assert step.traces == 2

    model, opt = model_and_opt()
    step = transpile(M.classify_step, skip_nonfinite=True)
    for batch in batches:
        step(model, opt, *batch)
    assert step.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])
               for p, q in zip(model.parameters(), eager.parameters()))


class _LayerDrop(nn.Module):
    """fairseq's LayerDrop (`torch.empty(1).uniform_()`) or transformers'
    (`torch.rand([])`): each layer skipped on a draw of the host's decision."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            p = torch.empty(1).uniform_() if self.draw == "uniform_" else torch.rand([])
            if self.training and p < 0.3:
                continue
            x = x + F.relu(nn.functional.dropout(layer(x), 0.1))
        return self.head(x)


@pytest.mark.parametrize("draw", ["uniform_", "rand"])
def test_layerdrop_decides_on_its_draws_as_eager(draw):
    """Traced on the call's values, each draw is eager's: torch's real-tensor
    propagation ran uniform_'s decomposition on the real twins again, a second
    draw that shifted every later one (capture/real_twins.py)."""
    torch.manual_seed(0)
    step = _classifies_as_eager(_LayerDrop(draw), torch.optim.SGD, calls=8)
    assert step.traces > 1   # the layers taken changed between calls



def _rank_layerdrop_vs_ddp():
    """Each rank skips its own layers (its draws differ): with
    find_unused_parameters, as DDP's, the skipped layers average with zeros."""
    rank = dist.get_rank()

    def train(step_fn, wrap):
        torch.manual_seed(0)
        model = _LayerDrop("uniform_")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = wrap(model)
        g = torch.Generator().manual_seed(rank)
        for i in range(5):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            torch.manual_seed(10 * i + rank)
            step_fn(net, opt, x, y)
        return M.state_of(model, opt)

    ours = train(transpile(M.classify_step, find_unused_parameters=True), lambda m: m)
    theirs = train(M.classify_step, lambda m: DDP(m, find_unused_parameters=True))
    return M.max_rel_error(ours, theirs)


@pytest.mark.slow
def test_layerdrop_on_2_ranks_equals_ddp(ranks2):
    assert ranks2.run(_rank_layerdrop_vs_ddp) == [0.0, 0.0]
