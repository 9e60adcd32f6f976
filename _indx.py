import sys, time, os, tempfile, json, torch, logging
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, "/work/main")
from transpiler import transpile, backends
import transpiler.bench as b
torch.set_num_threads(1)
backends._INDUCTOR_OPTIONS.update(json.loads(os.environ.get("PATCH", "{}")))
spec = b.MODELS[sys.argv[1]]
if os.environ.get("UNFOREACH"):
    sys.path.append("/tmp/prof")
    from unforeach import unforeach
    orig = backends._inductor
    def patched(gm, static, cudagraphs=False):
        run = None
        def r(*inputs):
            nonlocal run
            if run is None:
                t = time.perf_counter()
                g2 = unforeach(gm, list(inputs)); from collections import Counter; print(Counter(str(n.target) for n in gm.graph.nodes if "foreach" in str(n.target)), Counter(str(n.target) for n in g2.graph.nodes if "foreach" in str(n.target)))
                print("unforeach %.1fs nodes %d -> %d" % (time.perf_counter() - t, len(gm.graph.nodes), len(g2.graph.nodes)))
                run = orig(g2, static, cudagraphs)
            return run(*inputs)
        return r
    backends._inductor = patched
torch.manual_seed(0)
model = spec.build()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(0)
batches = [spec.make_batch(g, spec.batch_per_rank) for _ in range(12)]
step = transpile(b.train_step, mode="fuse_all_reduce", backend="inductor")
t = time.perf_counter(); step(model, opt, *batches[0]); first = time.perf_counter() - t
for x in batches[1:4]: step(model, opt, *x)
ts = []
for x in batches[4:]:
    t = time.perf_counter(); step(model, opt, *x); ts.append(time.perf_counter() - t)
print(os.environ.get("PATCH"), "first %.1fs" % first, {k: round(v, 2) for k, v in step.setup_split.items()}, "step %.2f ms" % (sorted(ts)[4] * 1e3))
