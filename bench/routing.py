"""Prefix- and load-aware routing through the Gateway API Inference Extension's endpoint picker against the
Service, side by side on the local cluster's real node (issue 54; docs/routing.md).

One InferenceDeployment of three engine pods with spec.routing: the operator renders the InferencePool and the
v1.5.0 picker (a pod) and the bundled gateway, Envoy in front of it (spec.routing.bundledGateway). The
same pods and knobs serve both arms: through Envoy and the picker, and through the resource's Service (kube-proxy
picks a pod at random). Two traces, Poisson arrivals at the same rate for both arms:
  shared   tenants with long system prompts and short questions (as llm-d's benchmark): the tenants' prompts
           together exceed one pod's KV cache (--kv-gb) and fit in the pool's, so where a request lands decides
           whether its prefix is cached;
  unique   prompts of the same length that share nothing: routing must not lose there.
Each arm of each round gets tenants and prompts of its own (fresh words), so no arm starts from a cache another
arm warmed. Reported: p90 TTFT, output tokens/s, each pod's requests, the pods' prefix-cache hit rate.
Needs root and what tests/cluster/test_routing.py needs (scripts/gateway-tools.sh, the images).

    python bench/routing.py
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import conditions, model_dir, pyplot, save  # noqa: E402

from chunkpilot.contract import metric_names as m  # noqa: E402
from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark  # noqa: E402
from chunkpilot.loadgen.workloads import RequestSpec  # noqa: E402

# plain words the tenants' prompts are drawn from (about 1.2 tokens each)
WORDS = ("bicycle helmet rental desk city river bridge museum garden station ticket price morning evening "
         "weather rain sun wind road map guide tour group child adult family lock key chain light bell basket "
         "seat wheel tire pump repair shop street park lake hill valley forest path sign corner market coffee "
         "bread lunch dinner hotel room night week month year today tomorrow always never often sometimes please "
         "thank answer question short long slow fast early late open close free paid card cash phone email "
         "office manager team staff customer visitor student teacher doctor nurse police fire water food music "
         "book paper pen table chair door window floor wall roof garden tree flower grass stone sand snow ice").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def trace(kind: str, rng: random.Random, schedule: random.Random, *, requests: int, rate: float, tenants: int,
          prefix_words: int, max_tokens: int) -> list[RequestSpec]:
    """Poisson arrivals; `shared`: one of `tenants` system prompts (fresh for this arm) and a short question;
    `unique`: a prompt of the same length that shares nothing. The arrival times and the tenant each request
    belongs to come from `schedule`, which both arms of a round seed alike: only the words differ between them
    (with a schedule of its own, 40 Poisson arrivals alone move an arm's tokens/s by +-20 %)."""
    systems = [f"You are the assistant of tenant {i}. {words(rng, prefix_words)}" for i in range(tenants)]
    out, t = [], 0.0
    for _ in range(requests):
        t += schedule.expovariate(rate)
        tenant = schedule.randrange(tenants)
        question = f"Question: {words(rng, 12)}?\nAnswer:"
        head = systems[tenant] if kind == "shared" else f"You are an assistant. {words(rng, prefix_words)}"
        out.append(RequestSpec(kind, f"{head}\n{question}", max_tokens, t))
    return out


@contextlib.contextmanager
def routed_cluster(work: Path, kv_gb: float, pods: int):
    """The node, the operator (the chart's ServiceAccount), the resource with spec.routing and Envoy; yields
    (Envoy's URL, the Service's URL, the engine pods' addresses)."""
    import kubernetes

    from tests.cluster.test_real_pods import poll
    from chunkpilot.operator import gateway
    from tests.cluster.test_routing import NAME, NS, Routed
    from tests.conftest import install_chart_accounts, install_crd, require_tool
    from tests.local_cluster import LocalCluster, engine_image, envoy_image, epp_image, find_node_binaries
    from tests.operator import gie
    from tests.operator.envoy import envoy_binary
    from tests.operator.operator_proc import Cluster, operator, sample

    found, image = find_node_binaries(), engine_image()
    for problem in (found, image):
        if isinstance(problem, str):
            raise SystemExit(problem)
    smollm2 = model_dir()
    with LocalCluster(work / "node", found, images=[image]) as cluster:
        install_crd(cluster)
        epp = cluster.add_image(*epp_image(work, require_tool(gie.EPP, gie.HOW)))
        envoy = cluster.add_image(*envoy_image(work, envoy_binary()))
        accounts = install_chart_accounts(cluster, work)
        k = Cluster(cluster.api())
        k.namespace(NS)
        op = operator(accounts["operator"], work, "--engine-image", image[0], "--allowed-host-path", smollm2,
                      "--epp-image", epp, "--envoy-image", envoy, "--default-cpu-request", "100m",
                      "--default-memory-request", "1Gi")
        with gie.installed_crds(cluster):
            try:
                op.start()
                # one torch thread a pod (three pods share two cores), a KV cache that holds a few tenants
                k.create(sample(NAME, NS, replicas=pods, engine__resources={"gpus": 0}, engine__maxNumSeqs=8,
                                engine__extraArgs=[f"--kv-cache-memory-gb={kv_gb}", "--threads=1"],
                                model__source=f"hostpath://{smollm2}", model__servedName="smollm2",
                                model__maxModelLen=1024, model__dtype="float32", tuning={"mode": "off"},
                                scheduler={"tokenBudget": 256, "maxChunk": 256},
                                monitoring={"serviceMonitor": False}, routing={"bundledGateway": True}))
                r = Routed(cluster, k, op)
                engines = poll(lambda: r.engines() if len(r.engines()) == pods else None, 600, "engine pods Ready",
                               r.diagnose)
                poll(lambda: r.ready({"app.kubernetes.io/name": "chunkpilot-epp"}), 120, "the picker Ready",
                     r.diagnose)
                poll(lambda: r.ready(gateway.gateway_labels(NAME)), 120, "Envoy Ready", r.diagnose)
                service = k.core.read_namespaced_service(NAME, NS).spec.cluster_ip
                yield r.gateway_url().removesuffix("/v1"), f"http://{service}:8000", [p.status.pod_ip for p in engines]
            finally:
                op.stop()
                with contextlib.suppress(kubernetes.client.ApiException):
                    k.core.delete_namespace(NS)


def counters(ips: list[str]) -> list[dict[str, float]]:
    from tests.cluster.test_disaggregation import metric

    return [{"requests": metric(ip, m.REQUEST_SUCCESS), "hits": metric(ip, m.PREFIX_CACHE_HITS),
             "queries": metric(ip, m.PREFIX_CACHE_QUERIES)} for ip in ips]


def arm(url: str, specs: list[RequestSpec], ips: list[str], label: str) -> dict:
    before = counters(ips)
    result = run_benchmark(BenchmarkConfig(base_url=url, model="smollm2", requests=specs, progress=False,
                                           label=label, timeout=300))
    after = counters(ips)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    s = result.summary
    hits, queries = sum(d["hits"] for d in delta), sum(d["queries"] for d in delta)
    return {"ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
            "output_tokens_per_s": s["output_token_throughput"], "completed": s["completed"], "failed": s["failed"],
            "duration_s": s["duration_s"], "per_pod_requests": [d["requests"] for d in delta],
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "errors": sorted({r.error for r in result.records if r.error})[:5]}


def merge(runs: list[dict]) -> dict:
    """An arm's rounds together: latencies as their median, throughput and counts summed over the time they took."""
    import statistics

    dur = sum(r["duration_s"] for r in runs)
    return {"ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in runs),
            "ttft_p90_s": statistics.median(r["ttft_p90_s"] for r in runs),
            "output_tokens_per_s": sum(r["output_tokens_per_s"] * r["duration_s"] for r in runs) / dur,
            "completed": sum(r["completed"] for r in runs), "failed": sum(r["failed"] for r in runs),
            "per_pod_requests": [sum(x) for x in zip(*(r["per_pod_requests"] for r in runs))],
            "prefix_hit_rate": statistics.mean(r["prefix_hit_rate"] for r in runs),
            "errors": sorted({e for r in runs for e in r["errors"]}), "rounds": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # past the Service's capacity, and long enough that the backlog, not the arrival window, sets the duration
    ap.add_argument("--rate", type=float, default=2.4, help="shared trace: requests per second, both arms")
    ap.add_argument("--requests", type=int, default=160, help="shared trace: requests per arm and round")
    ap.add_argument("--unique-rate", type=float, default=0.5,
                    help="unique trace: requests per second (every prompt is computed whole: a lower rate)")
    ap.add_argument("--unique-requests", type=int, default=40)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=400, help="words of each tenant's system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=0.08, help="each pod's KV cache (a few tenants' prompts)")
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="routing")
    args = ap.parse_args()
    rng = random.Random(0)
    got: dict[str, dict[str, list[dict]]] = {t: {"gateway": [], "service": []} for t in ("shared", "unique")}
    with tempfile.TemporaryDirectory() as tmp, routed_cluster(Path(tmp), args.kv_gb, args.pods) as (gw, svc, ips):
        for r in range(args.rounds):
            for kind in got:
                order = ("gateway", "service") if r % 2 == 0 else ("service", "gateway")
                for name in order:
                    shared = kind == "shared"
                    specs = trace(kind, rng, random.Random(f"{kind}/{r}"),
                                  requests=args.requests if shared else args.unique_requests,
                                  rate=args.rate if shared else args.unique_rate, tenants=args.tenants,
                                  prefix_words=args.prefix_words, max_tokens=args.max_tokens)
                    got[kind][name].append(arm(gw if name == "gateway" else svc, specs, ips, f"{kind}/{name}/r{r}"))
                    last = got[kind][name][-1]
                    print(f"round {r} {kind:6s} {name:7s}: TTFT p90 {last['ttft_p90_s']:.2f} s, "
                          f"{last['output_tokens_per_s']:.1f} tok/s, hit rate {last['prefix_hit_rate']:.0%}, "
                          f"per pod {last['per_pod_requests']}, failed {last['failed']} {last['errors']}")
    traces = {kind: {name: merge(runs) for name, runs in arms.items()} for kind, arms in got.items()}
    ratios = {kind: {"ttft_p90_service_over_gateway": a["service"]["ttft_p90_s"] / a["gateway"]["ttft_p90_s"],
                     "tokens_per_s_gateway_over_service":
                         a["gateway"]["output_tokens_per_s"] / a["service"]["output_tokens_per_s"]}
              for kind, a in traces.items()}
    for kind, ra in ratios.items():
        print(f"{kind}: p90 TTFT {ra['ttft_p90_service_over_gateway']:.2f}x lower through the picker, "
              f"output tokens/s {ra['tokens_per_s_gateway_over_service']:.2f}x")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, title) in zip(axes, (("ttft_p90_s", "p90 TTFT, s"), ("output_tokens_per_s", "output tokens/s"))):
        xs = range(len(traces))
        for i, name in enumerate(("service", "gateway")):
            ax.bar([x + i * 0.4 for x in xs], [traces[k][name][key] for k in traces], 0.4,
                   label="Service (random)" if name == "service" else "Envoy + endpoint picker")
        ax.set_xticks([x + 0.2 for x in xs], list(traces))
        ax.set_title(title)
        ax.legend()
    save(args.out, {"conditions": conditions(rate=args.rate, requests=args.requests, unique_rate=args.unique_rate,
                                             unique_requests=args.unique_requests, tenants=args.tenants,
                                             prefix_words=args.prefix_words, max_tokens=args.max_tokens,
                                             kv_gb=args.kv_gb, pods=args.pods, rounds=args.rounds),
                    "traces": traces, "ratios": ratios}, fig)


if __name__ == "__main__":
    main()
