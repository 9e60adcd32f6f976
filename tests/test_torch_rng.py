"""torch's random number generator inside the step (transpiler/capture/
torch_rng.py, rng_lanes.py, rng_plan.py): torch.manual_seed, set_rng_state and
torch.random.fork_rng act on every call as in eager, and torch.utils.checkpoint
recomputes a block with dropout from the forward's state, or they are refused.

Each case runs the eager step and the transpiled step on identical copies from
the same seed, several calls in a row without reseeding between them: the
returned values, parameters, gradients and optimizer state bit for bit, and
the generator's state after every call (which the next call draws from)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from tests import models as M
from transpiler import TranspileError, transpile

CALLS = 3


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc, self.drop = nn.Linear(dim, dim), nn.Dropout(0.5)

    def forward(self, x):
        # a constant the recomputation makes anew: equal values, another node
        return self.drop(torch.tanh(self.fc(x)) * torch.tensor(0.5))


class Checkpointed(nn.Module):
    """A dropout outside the checkpointed blocks and one inside each (the
    recomputation in the backward pass draws the forward's masks again)."""

    def __init__(self, reentrant: bool | None = None, dim=16):
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.drop = nn.Linear(dim, dim), nn.Dropout(0.2)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.drop(self.inp(x))
        for block in self.blocks:
            h = block(h) if self.reentrant is None else \
                checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def plain_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _batches(n=CALLS, batch=8, dim=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, dim, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n)]


def _run(step, model, opt, calls):
    """Each call's outputs, state and generator state, from one seed; the
    caller draws between calls too."""
    torch.manual_seed(100)
    results = []
    for args in calls:
        torch.rand(())
        out = step(model, opt, *args)
        state = M.state_of(model, opt)
        state.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        results.append(([t.detach().clone() for t in torch.utils._pytree.tree_leaves(out)],
                        state, torch.get_rng_state()))
    return results


def _equal_runs(ours, theirs):
    for i, ((out_a, state_a, rng_a), (out_b, state_b, rng_b)) in enumerate(zip(ours, theirs)):
        assert len(out_a) == len(out_b) and all(torch.equal(a, b) for a, b in zip(out_a, out_b)), i
        assert state_a.keys() == state_b.keys(), i
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), \
            (i, [k for k in state_a if not torch.equal(state_a[k], state_b[k])])
        assert torch.equal(rng_a, rng_b), f"the generator after call {i}"


def _compare(step_fn, model, calls=None, backend="eager", tolerance=None, optimizer=None):
    """The transpiled step against the eager one; returns the transpiled step."""
    calls = calls if calls is not None else _batches()
    make_opt = optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    twin = copy.deepcopy(model)
    eager = _run(step_fn, model, make_opt(model), calls)
    step = transpile(step_fn, backend=backend)
    ours = _run(step, twin, make_opt(twin), calls)
    if tolerance is None:
        _equal_runs(ours, eager)
    else:
        for (out_a, state_a, rng_a), (out_b, state_b, rng_b) in zip(ours, eager):
            assert M.max_rel_error(state_a, state_b) < tolerance
            assert torch.equal(rng_a, rng_b)
    return step


def _model(reentrant=None):
    torch.manual_seed(0)
    return Checkpointed(reentrant)


# (a) torch.manual_seed inside the step

def seeded_constant(model, opt, x, y):
    torch.manual_seed(1234)
    return plain_step(model, opt, x, y)


def seeded_per_call(model, opt, x, y, i):
    torch.manual_seed(1000 + 7 * i)
    return plain_step(model, opt, x, y)


def test_manual_seed_constant_acts_on_every_call():
    _compare(seeded_constant, _model())


def test_manual_seed_from_an_int_argument_acts_on_every_call():
    """`i` is baked into the first trace, lifted at the second: the seed is
    then computed from it on the host before every run."""
    calls = [(x, y, i) for i, (x, y) in enumerate(_batches(5))]
    step = _compare(seeded_per_call, _model(), calls)
    assert step.traces == 2


def seeded_without_draws(model, opt, x, y):
    torch.manual_seed(5)
    return plain_step(model, opt, x, y)


def test_manual_seed_in_a_step_that_draws_nothing():
    torch.manual_seed(0)
    _compare(seeded_without_draws, M.make("mlp"), [b for b in M.batches("mlp", CALLS, 8)])


def seeded_after_dropout(model, opt, x, y):
    opt.zero_grad()
    h = F.dropout(model.inp(x), 0.3)
    torch.manual_seed(7)   # eager: the noise below is the same on every call
    h = h + 0.1 * torch.randn_like(h)
    loss = F.cross_entropy(model.head(h), y)
    loss.backward()
    opt.step()
    return loss


def test_manual_seed_after_a_draw():
    """The dropout draws from the call's state, the noise from the seed, and
    the generator is left seeded plus the noise, as in eager."""
    _compare(seeded_after_dropout, _model())


def state_from_argument(model, opt, x, y, state):
    torch.set_rng_state(state)
    return plain_step(model, opt, x, y)


def test_set_rng_state_from_an_argument_acts_on_every_call():
    states = [torch.Generator().manual_seed(10 + i).get_state() for i in range(CALLS)]
    calls = [(x, y, s) for (x, y), s in zip(_batches(), states)]
    _compare(state_from_argument, _model(), calls)


# (b) torch.random.fork_rng inside the step

def fork_seeded_first(model, opt, x, y):
    """Noise from a seed of its own, the dropout from the call's state."""
    with torch.random.fork_rng():
        torch.manual_seed(3)
        noise = torch.randn_like(x)
    return plain_step(model, opt, x + 0.1 * noise, y)


def fork_seeded_after_dropout(model, opt, x, y):
    opt.zero_grad()
    h = F.dropout(model.inp(x), 0.3)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        h = h + 0.1 * torch.rand_like(h)
    h = F.dropout(h, 0.3)
    loss = F.cross_entropy(model.head(h), y)
    loss.backward()
    opt.step()
    return loss


def fork_first(model, opt, x, y):
    """An unseeded fork first: its noise and the model's dropout both draw
    from the state the call found."""
    with torch.random.fork_rng():
        noise = torch.randn_like(x)
    return plain_step(model, opt, x + 0.1 * noise, y)


def fork_repeats(model, opt, x, y):
    """A fork that draws what is drawn after it: the same numbers."""
    with torch.random.fork_rng():
        a = torch.rand_like(x)
    b = torch.rand_like(x)
    loss = plain_step(model, opt, x + a - b, y)
    return loss, a - b


@pytest.mark.parametrize("step_fn", [fork_seeded_first, fork_seeded_after_dropout, fork_first,
                                     fork_repeats])
def test_fork_rng(step_fn):
    step = _compare(step_fn, _model())
    if step_fn is fork_repeats:   # one draw in the program, its value used twice
        assert sum("rand_like" in str(n.target) for n in step.program.graph.nodes) == 1


# (c) torch.utils.checkpoint around a block with dropout

@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputes_the_forwards_masks(reentrant):
    step = _compare(plain_step, _model(reentrant))
    # The recomputation's masks are the forward's: 3 dropouts, 3 draws.
    assert sum("bernoulli" in str(n.target) for n in step.program.graph.nodes) == 3


def test_checkpoint_with_batches_of_changing_size():
    """The second size traces the step with symbolic batch dimensions."""
    calls = [(x[:n], y[:n]) for (x, y), n in zip(_batches(4), (8, 6, 4, 7))]
    step = _compare(plain_step, _model(False), calls)
    assert step.traces == 2


# (d) transformers' GPT-2 with gradient checkpointing

def lm_step(model, opt, tokens):
    opt.zero_grad()
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    return model.train()


def test_gpt2_gradient_checkpointing_equals_eager():
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randint(0, 64, (4, 17), generator=g),) for _ in range(CALLS)]
    step = _compare(lm_step, _gpt2(), calls,
                    optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    # embeddings, and per layer attention and two residuals: the recomputed
    # layers draw no mask of their own
    assert sum("bernoulli" in str(n.target) for n in step.program.graph.nodes) == 7


# (e) against torch DDP on 2 ranks

def rank_checkpoint_vs_ddp(mode: str, reentrant: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = _model(reentrant), _model(reentrant)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    step = transpile(plain_step, mode=mode)
    results = []
    for model, net, run, opt in ((ours, ours, step, opts[0]),
                                 (theirs, DDP(theirs), plain_step, opts[1])):
        torch.manual_seed(100 + rank)   # each rank its own masks, as under DDP
        for x, y in _batches(4, batch=8):
            run(net, opt, x[rank::world], y[rank::world])
        results.append((M.state_of(model, opt), torch.get_rng_state()))
    (a, rng_a), (b, rng_b) = results
    return M.max_rel_error(a, b) == 0.0 and torch.equal(rng_a, rng_b)


@pytest.mark.parametrize("mode", ["grad_allreduce", "fuse_all_reduce"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_equals_ddp(mode, reentrant, ranks2):
    assert ranks2.run(rank_checkpoint_vs_ddp, mode, reentrant) == [True, True]


# (f) under inductor

@pytest.mark.compiles
def test_checkpoint_under_inductor():
    _compare(plain_step, _model(False), backend="inductor", tolerance=1e-5)


@pytest.mark.compiles
@pytest.mark.parametrize("step_fn", [fork_seeded_after_dropout, seeded_after_dropout])
def test_seeded_draws_under_inductor(step_fn):
    """Twice: the second step's program is the first's, which inductor's
    cache would give back with a copy of its generator."""
    for _ in range(2):
        _compare(step_fn, _model(), backend="inductor", tolerance=1e-5)


# (g) refused, naming the line, with nothing changed

def fork_after_dropout(model, opt, x, y):
    opt.zero_grad()
    h = F.dropout(model.inp(x), 0.3)
    with torch.random.fork_rng():
        h = h + 0.1 * torch.randn_like(h)   # from the state after the dropout ...
    h = F.dropout(h, 0.3)                   # ... and so is this mask
    loss = F.cross_entropy(model.head(h), y)
    loss.backward()
    opt.step()
    return loss


def fork_last(model, opt, x, y):
    opt.zero_grad()
    h = F.dropout(model.inp(x), 0.3)
    with torch.random.fork_rng():
        h = h + 0.1 * torch.randn_like(h)
    loss = F.cross_entropy(model.head(h), y)
    loss.backward()
    opt.step()
    return loss


def calls_seed(model, opt, x, y):
    torch.seed()
    return plain_step(model, opt, x, y)


GENERATOR = torch.Generator().manual_seed(0)


def own_generator(model, opt, x, y):
    noise = torch.rand(x.shape, generator=GENERATOR)
    return plain_step(model, opt, x + noise, y)


def seeds_the_generator_object(model, opt, x, y):
    torch.default_generator.manual_seed(1)
    return plain_step(model, opt, x, y)


SAVED = torch.get_rng_state()


def sets_a_saved_state(model, opt, x, y):
    torch.set_rng_state(SAVED)
    return plain_step(model, opt, x, y)


def dropout_seeded_and_not(model, opt, x, y):
    opt.zero_grad()
    h = F.dropout(model.inp(x), 0.3)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        h = F.dropout(h, 0.3)
    loss = F.cross_entropy(model.head(h), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("step_fn, message", [
    (fork_after_dropout, "then draws other numbers from it"),
    (dropout_seeded_and_not, "from two states of torch's cpu generator"),
    (fork_last, "leaves torch's random number generator (cpu) at its state after 1 of"),
    (calls_seed, "calls torch.seed()"),
    (own_generator, "draws from a torch.Generator of its own"),
    (sets_a_saved_state, "neither one get_rng_state() returned inside the step nor an argument"),
    # seen only by its effect, after the trace: no line to name
    (seeds_the_generator_object, "changes torch's random number generator other than"),
])
def test_refused_naming_the_line_with_nothing_changed(step_fn, message):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batches(1)[0]
    plain_step(model, opt, x, y)   # a .grad and momentum to keep
    before = M.state_of(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(8)
    rng = torch.get_rng_state()
    with pytest.raises(TranspileError) as error:
        transpile(step_fn)(model, opt, x, y)
    assert message in str(error.value)
    assert "test_torch_rng.py:" in str(error.value) or step_fn is seeds_the_generator_object
    after = M.state_of(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_failed_run_leaves_the_generator_as_it_was():
    """The host seeds before the run; a run that raises restores the state
    the call found."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(seeded_constant)
    x, y = _batches(1)[0]
    step(model, opt, x, y)
    torch.manual_seed(9)
    rng = torch.get_rng_state()
    with pytest.raises(IndexError):
        step(model, opt, x, y + 10)   # a class index out of range: the kernel raises
    assert torch.equal(torch.get_rng_state(), rng)


def micro_step(model, opt, batches):
    opt.zero_grad()
    for x, y in batches:
        (F.cross_entropy(model(x), y) / 4).backward()
    opt.step()
    return torch.rand(())


def seeded_micro_step(model, opt, batches):
    torch.manual_seed(11)
    return micro_step(model, opt, batches)


@pytest.mark.parametrize("step_fn", [micro_step, seeded_micro_step])
def test_micro_batch_loop(step_fn, caplog):
    """Checkpointed blocks in a rolled micro-batch loop; a seed, which the
    host sets once per call, makes the loop be traced unrolled."""
    batches = _batches(12, batch=4)
    calls = [(batches[i:i + 4],) for i in range(0, 12, 4)]
    model = _model(False)
    twin = copy.deepcopy(model)
    step = transpile(step_fn, micro_batches="batches")
    eager = _run(step_fn, model, torch.optim.SGD(model.parameters(), lr=0.1), calls)
    with caplog.at_level("INFO", logger="transpiler"):
        ours = _run(step, twin, torch.optim.SGD(twin.parameters(), lr=0.1), calls)
    _equal_runs(ours, eager)
    rolled = "micro-batch loop" in str(step.program)
    assert rolled == (step_fn is micro_step)
    assert ("the step seeds or sets torch's random number generator" in caplog.text) == (
        step_fn is seeded_micro_step)


@pytest.mark.parametrize("step_fn", [plain_step, fork_seeded_after_dropout])
def test_verify_agrees(step_fn):
    """verify=N runs the eager step first (forking the generator), then the
    program from the same state, with the host's seeds and side generators."""
    model = _model(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(step_fn, verify=2)
    for x, y in _batches():
        step(model, opt, x, y)
