import sys, copy, torch
from tests import zoo
from transpiler import transpile
torch.set_num_threads(1)
arch = zoo.by_name(sys.argv[1]); step = zoo.step_of(arch)
torch.manual_seed(0); ours = arch.build(); theirs = copy.deepcopy(ours); comp = copy.deepcopy(ours)
opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs, comp)]
t = transpile(step, backend="inductor")
compiled = torch.compile(comp)
g = torch.Generator().manual_seed(1)
def diff(sa, sb):
    return max((((sa[k].double()-sb[k].double()).abs().max()/sb[k].double().abs().max().clamp_min(1e-12)).item(), k) for k in sb if sa[k].is_floating_point())
for i in range(3):
    b = arch.batch(g)
    torch.manual_seed(i); a = t(ours, opts[0], b)
    torch.manual_seed(i); e = step(theirs, opts[1], b)
    torch.manual_seed(i); c = step(compiled, opts[2], b)
    sa, sb, sc = ours.state_dict(), theirs.state_dict(), comp.state_dict()
    print(i, "ours-eager", diff(sa, sb), "compile-eager", diff(sc, sb), "ours-compile", diff(sa, sc), flush=True)
