"""Where compiled bf16 loses on the GPU: profiles eager and compiled pipelines (temporary)."""
import sys, time, json, os
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import _common
_common.prepare_process()
import torch
import conveyor
import conveyor.engine.compiling as compiling
import gpu as G

sizes = G.Sizes(os.environ.get("SMOKE") == "1")
dev = torch.device("cpu" if os.environ.get("SMOKE") == "1" else "cuda:0")
x, y = sizes.batch_on(dev)
out = {}

def pipe(options):
    torch.manual_seed(0)
    model = sizes.model().to(dev)
    p = conveyor.Pipeline(model, loss_fn=G.lm_loss, chunks=8, schedule="1f1b", recompute="never",
                          balance=G.balanced(sizes, 2), devices=[dev] * 2, **options)
    return G.pipe_step(p, x, y, dev)

steps = {}
steps["eager bf16"] = pipe({"precision": "bf16"})
steps["compiled bf16"] = pipe({"compile": True, "precision": "bf16"})
saved = compiling.mark_dynamic
compiling.mark_dynamic = lambda t, d: None
steps["compiled bf16 static"] = pipe({"compile": True, "precision": "bf16"})
steps["compiled bf16 static"]()
compiling.mark_dynamic = saved
torch.manual_seed(0)
plain = sizes.model().to(dev)
steps["plain eager autocast"] = G.autocast(G.plain_step(plain, x, y, 8), dev, torch.bfloat16)
torch.manual_seed(0)
whole = torch.compile(sizes.model().to(dev))
steps["plain whole-compiled autocast"] = G.autocast(G.plain_step(whole, x, y, 8), dev, torch.bfloat16)
torch.manual_seed(0)
layered = sizes.model().to(dev)
for layer in layered:
    layer.compile()
steps["plain per-layer compiled autocast"] = G.autocast(G.plain_step(layered, x, y, 8), dev, torch.bfloat16)
t = time.perf_counter()
for name, s in steps.items():
    s(); s()
print("warm-up", time.perf_counter() - t, flush=True)
out["step_ms"] = G.time_configs(steps, 5)
for k, v in out["step_ms"].items():
    print(f"{k:40s} {v:8.1f} ms", flush=True)
from torch.profiler import profile, ProfilerActivity
for name in ("eager bf16", "compiled bf16", "plain eager autocast", "plain per-layer compiled autocast"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps[name]()
    ev = prof.key_averages()
    rows = sorted(ev, key=lambda e: -e.self_device_time_total)[:14]
    print(f"\n== {name}: top kernels by device time")
    for e in rows:
        print(f"  {e.key[:70]:70s} {e.self_device_time_total/1e3:8.2f} ms  x{e.count}")
    rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]
    print(f"== {name}: top by self CPU time")
    for e in rows:
        print(f"  {e.key[:70]:70s} {e.self_cpu_time_total/1e3:8.2f} ms  x{e.count}")
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), name.replace(" ", "_") + ".json"))
from torch._dynamo.utils import counters
print("unique graphs", counters["stats"]["unique_graphs"])
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
