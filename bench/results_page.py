"""docs/results.md from the result files: every figure the docs show is read here from bench/results/*.json, with
the conditions each run recorded (time, commit, machine, torch, GPU). A test regenerates the page and fails when it
differs from the committed one, so a figure cannot be edited by hand or left behind by a new run.

    python bench/results_page.py            # rewrites docs/results.md and the README's headline
    python bench/results_page.py --check    # exit 1 when either is not what the files say

Pure json: no torch, no matplotlib (the test runs it anywhere)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
# the README's one generated paragraph, between these markers
HEADLINE = re.compile(r"(<!-- results:headline[^>]*-->\n)(.*?)(<!-- /results:headline -->)", re.S)
# conditions keys shown in every section's "measured on" line; the rest are the run's own settings
MACHINE_KEYS = ("time", "commit", "machine", "cpus", "torch", "threads", "gpu")


def pct(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f} %"


def times(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}×"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def measured_on(c: dict) -> str:
    commit = c.get("commit") or "not recorded (run before results carried it)"
    gpu = c.get("gpu") or "none"
    return (f"Measured {c.get('time', '?')} at commit `{commit}` on {c.get('machine', '?')}, {c.get('cpus', '?')} "
            f"CPUs, torch {c.get('torch', '?')}, {c.get('threads', '?')} threads, GPU: {gpu}.")


def settings(c: dict) -> str:
    rest = {k: v for k, v in c.items() if k not in MACHINE_KEYS}
    if not rest:
        return ""
    return "Run conditions: " + ", ".join(f"`{k}` = `{json.dumps(v, sort_keys=True)}`" for k, v in rest.items()) + "."


# -- one renderer per result file ------------------------------------------------------------------------------------

def chunk_overhead(d: dict) -> list[str]:
    s = {k: statistics.median(v) for k, v in d["seconds"].items()}
    one, chunked = s["one-shot"], next(v for k, v in s.items() if k != "one-shot")
    r = d["ratio_chunked_over_one_shot"]
    return table(["what", "measured", "target", "verdict"], [[
        f"one {d['tokens']}-token prompt in {d['chunk']}-token chunks against one shot",
        f"{times(r)} ({chunked:.2f} s vs {one:.2f} s, medians)", f"≤ {times(d['target'])}",
        verdict(r <= d["target"])]])


def roofline(d: dict) -> list[str]:
    dec, pre = d["decode"], d["prefill"]
    return table(["what", "measured", "target", "verdict"], [
        [f"batch-1 decode against the copy bound ({dec['bandwidth_GBps']:.1f} GB/s, "
         f"{dec['bytes_per_token'] / 1e6:.0f} MB a token)",
         f"{dec['tokens_per_s']:.1f} of {dec['bound_tokens_per_s']:.1f} tokens/s = {pct(dec['fraction_of_bound'])}",
         f"≥ {pct(dec['target'])}", verdict(dec["fraction_of_bound"] >= dec["target"])],
        [f"{pre['prompt_tokens']}-token prefill against matmul FLOP/s ({pre['matmul_GFLOPs']:.0f} GFLOP/s)",
         f"{pre['tokens_per_s']:.0f} of {pre['bound_tokens_per_s']:.0f} tokens/s = {pct(pre['fraction_of_bound'])}",
         f"≥ {pct(pre['target'])}", verdict(pre["fraction_of_bound"] >= pre["target"])]])


def stall(d: dict) -> list[str]:
    rows = [[name, f"{r['chat_itl_p99_s'] * 1000:.0f} ms", f"{r['decode_step_s'] * 1000:.0f} ms",
             f"**{times(r['p99_over_decode_step'])}**", f"{r['long_ttft_mean_s']:.1f} s"]
            for name, r in d["results"].items()]
    best = min(r["p99_over_decode_step"] for name, r in d["results"].items() if name.startswith("chunked"))
    return table(["knobs", "chat ITL p99", "decode-only step", "p99 ÷ step", "long prompts' mean TTFT"], rows) + [
        "", f"Target: chunked p99 ÷ step ≤ {times(d['target_chunked_p99_over_step'])}: "
            f"{verdict(best <= d['target_chunked_p99_over_step'])} (best chunked {times(best)})."]


def vs_transformers(d: dict) -> list[str]:
    hf = d["transformers_tokens_per_s"]
    return table(["what", "measured", "target", "verdict"], [[
        "output tokens/s against transformers `generate` at its best batch size",
        f"{d['chunkpilot_tokens_per_s']:.1f} vs {hf[str(d['best_batch'])]:.1f} (batch {d['best_batch']}) = "
        f"**{times(d['ratio'])}**", f"≥ {times(d['target'], 0)}", verdict(d["ratio"] >= d["target"])]])


def predictor_vs_sim(d: dict) -> list[str]:
    rows = [[r["mix"], f"{r['rate']:g}", f"{r['token_budget']}/{r['max_chunk']}",
             f"{r['itl_predicted'] / r['itl_simulated']:.2f}", f"{r['ttft_predicted'] / r['ttft_simulated']:.2f}",
             f"{r['utilization']:.2f}"] for r in d["rows"]]
    return [f"ITL p99 predicted within 25 % of the simulated one in **{d['itl_within_25pct']} of "
            f"{len(d['rows'])}** cases.", ""] + table(
        ["mix", "req/s", "knobs", "ITL p99 predicted ÷ simulated", "TTFT p99 predicted ÷ simulated",
         "prefill utilization"], rows)


def sim_accuracy(d: dict) -> list[str]:
    names = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99")
    rows = [[k] + [f"{100 * r['relative_error'][n]:+.0f} %" for n in names] for k, r in d["results"].items()]
    return [f"Median |error| **{pct(d['median_abs_error'])}**, max {pct(d['max_abs_error'])} (simulated against "
            "the real server on the same trace; + means the simulator is slower).", ""] + table(
        ["knobs"] + [n.replace("_", " ") for n in names], rows)


def tensor_parallel(d: dict) -> list[str]:
    rows = [[name, f"{c['prefill_step_seconds'] * 1000:.0f} ms", f"{c['decode_step_seconds'] * 1000:.0f} ms",
             f"{times(c['prefill_vs_same_cores'])} · {times(c['decode_vs_same_cores'])} of {c['same_cores_as']}",
             f"{max(c['weight_bytes_per_rank']) / 2 ** 20:.0f} MiB"] for name, c in d["configs"].items()]
    return table(["configuration", "prefill step", "decode step", "speed-up on the same cores (prefill · decode)",
                  "weights per rank"], rows)


def _tuner_scenarios(d: dict) -> list[str]:
    modes = [m for m in ("model", "blackbox") if any(m in s["modes"] for s in d["scenarios"])]

    def cell(s: dict | None) -> str:
        if s is None:
            return "—"
        return (f"{s['seeds_at_95pct']}/{s['seeds']} (min {pct(s['min_of_grid_best'], 1)}) · "
                f"{s['median_trials_to_95']:g} · {pct(s['median_share_over_slo'])} (max "
                f"{pct(s['max_share_over_slo'])}) · {s['median_windows_over_2x']:g}")
    rows = []
    for s in d["scenarios"]:
        best = s["grid_best"]
        rows.append([s["cost"], f"{s['rate']:g}, {s['itl_slo']:g} s",
                     f"{best['knobs'][0]}/{best['knobs'][1]}: {best['goodput']:.2f} req/s "
                     f"({times(best['goodput'] / s['fixed_2048_goodput'])} fixed 2048)"]
                    + [cell(s["modes"].get(m, {}).get("summary")) for m in modes])
    for key, t in d["totals"].items():
        cost, mode = key.split("/")
        line = (f"**{t['at_95pct']}/{t['runs']}** · {t['median_trials_to_95']:g} · **{pct(t['median_share_over_slo'])}**"
                f" · {t['median_windows_over_2x']:g}; median {pct(t['median_of_grid_best'], 1)} of the grid best, "
                f"{times(t['median_vs_fixed_2048'])} fixed 2048")
        rows.append([f"{cost}, all", "", ""] + [line if m == mode else "" for m in modes])
    head = [f"{m}: seeds ≥ 95 % of grid best (worst) · median trials to 95 % · median windows over the SLO (worst "
            "seed) · median windows over 2×" for m in modes]
    return table(["cost", "req/s, ITL SLO", "grid best"] + head, rows)


def shortfall(rows: list[dict] | None) -> str:
    """The demo report's shortfall: which knobs the tuned group ran when its requests missed (which decision cost
    it against the best fixed knobs in hindsight); runs recorded before it was kept show a dash."""
    if rows is None:
        return "—"
    missed = [r for r in rows if r["missed"]]
    if not missed:
        return "none"
    return "; ".join(f"{r['knobs'][0]}/{r['knobs'][1]}: {r['missed']} of {r['requests']}" for r in missed[:3])


def _sizing_cell(r: dict) -> str:
    """How the run's sizing went: checks needed, passed or not, and other programs' share of the CPU per phase."""
    z = r.get("sizing")
    if not z:
        return "—"
    b = z["busy"]
    busy = ", ".join(x for x in (
        f"probe {pct(b['probe'])}" if b.get("probe") is not None else "",
        "checks " + "/".join(pct(c) for c in b["checks"]) if any(c is not None for c in b.get("checks") or []) else "",
        f"load {pct(b['load'])}" if b.get("load") is not None else "") if x)
    took = f" ({z['seconds']:.0f} s)" if z.get("seconds") else ""
    return (f"{'passed' if z['passed'] else '**not passed**'} after {z['checks_needed']}{took}"
            f"{'; others took ' + busy if busy else ''}")


def demo_runs(d: dict) -> list[str]:
    rows = []
    for i, r in enumerate(d["runs"], 1):
        c, co = r["config"], (r["probe"].get("coefficients") or {})
        checks = r.get("checks") or []
        last = checks[-1] if checks else None
        def s(v):  # a failed request's infinite ITL is null in the JSON
            return "—" if v is None else f"{v:.2f} s"
        check = "—" if last is None else (
            f"{len(checks)}: {last['knobs'][0]}/{last['knobs'][1]} {s(last['counted_itl'])} · start-up "
            f"{s(last['start_itl'])} · {'passed' if last['ok'] else '**not passed**'}")
        fit = ", ".join(f"{1000 * co[k]:.3g} ms" for k in ("overhead", "prefill_tokens", "decode_seqs",
                                                           "kv_kilotokens") if k in co)
        load = (f"{c['rate']:g} req/s, ITL SLO {c['itl_slo']:g} s, outputs {c['output_scale']:g}×, "
                f"long prompts {pct(c['rag_scale'])}")
        if r.get("stopped"):
            rows.append([str(i), fit, load, check, "**stopped before the load**", "—", "—", "—", "—", "—",
                         _sizing_cell(r)])
            continue
        h = r.get("hindsight") or {}
        rows.append([str(i), fit, load, check,
                     f"**{pct(r['attainment']['tuned'])} vs {pct(r['attainment']['fixed'])}**",
                     f"{r['goodput']['tuned']:.2f} vs {r['goodput']['fixed']:.2f} req/s "
                     f"(**{times(r['goodput']['ratio'])}**)",
                     f"{r.get('tuner_windows_over_slo', '?')} of {r.get('tuner_windows', '?')}",
                     times(r.get("busy_contention")),
                     (f"{h['best'][0]}/{h['best'][1]}: {pct(h.get('attainment'))}, {h['goodput']:.2f} req/s "
                      f"(tuned **{times(r['goodput']['tuned'] / h['goodput'])}**)"
                      if h.get("best") and h.get("goodput") else
                      f"{h['best'][0]}/{h['best'][1]}: {pct(h.get('attainment'))}" if h.get("best") else "—"),
                     shortfall(r.get("shortfall")), _sizing_cell(r)])
    ran = [r for r in d["runs"] if not r.get("stopped")]
    spread = d.get("probe_spread") or {}
    agree = ", ".join(f"{k} ±{pct(v['max_deviation'])} ({'/'.join(sorted(set(s or '?' for s in v['statuses'])))})"
                      for k, v in spread.items() if v.get("max_deviation") is not None)
    met = all(r["attainment"]["tuned"] >= 0.9 and (r["goodput"]["ratio"] or 0) >= 1.25 for r in ran)
    hindsight = [r["goodput"]["tuned"] / r["hindsight"]["goodput"] for r in ran
                 if (r.get("hindsight") or {}).get("goodput")]
    close = bool(ran) and len(hindsight) == len(ran) and all(x >= 0.98 for x in hindsight) and \
        all(r["attainment"]["tuned"] >= 0.95 for r in ran)
    stopped = len(d["runs"]) - len(ran)
    out = table(["run", "probe fit: per step, prompt token, decode, 1k keys", "sized load",
                 "checks: last one's counted knobs · start-up knobs · verdict", "SLO attainment tuned vs fixed",
                 "goodput tuned vs fixed", "tuner windows over an SLO", "busy phase's steps vs the fit",
                 "best fixed knobs in hindsight", "tuned requests missed, by the knobs that ran",
                 "sizing: checks, host busy with other programs"], rows)
    busy = d.get("busy_loop_seconds")
    out += ["", (f"Each run with one busy-loop process (`python -c 'while True: pass'`) for {busy:g} s from the moment "
                 "its first check started (issue 41's recipe). " if busy else "") +
            f"Targets (every run that ran its load ≥ 90 % tuned attainment and ≥ 1.25× goodput"
            f"{', or a stop before the load' if busy else ''}): {verdict(met and (bool(busy) or not stopped))}"
            f"{f'; {stopped} stopped before the load' if stopped else ''}; issue 36's (every run ≥ 95 % and "
            f"goodput ≥ 0.98× the best fixed knobs in hindsight): {verdict(close)}."
            + (f" The probe fits' coefficients against their mean: {agree}." if agree else "")]
    pr = d.get("prediction")
    if pr:
        out += ["", f"Does the check predict the run? Passed checks: {pr['passed']}, of which followed by a winning "
                    f"run: {pr['passed_then_won']}; failed checks: {pr['failed']}, of which the demo stopped "
                    f"before the load: {pr['failed_then_stopped']}, ran and lost: {pr['failed_then_lost']}."]
    return out


def autoscale(d: dict) -> list[str]:
    t = d["totals"]
    rows = []
    for s in d["per_seed"]:
        co = s["coordinated"]
        frozen = next((v for k, v in s["replicas"].items() if k.startswith("tuned-once")), None)
        start = s["replicas"].get("start-up knobs")
        rows.append([str(s["seed"]), f"{pct(co['attainment'])} · {co['replica_seconds']:.0f}",
                     pct(s["knobs"]["attainment"]),
                     "—" if start is None else f"{pct(start['match']['attainment'])} · "
                                               f"{start['match']['replica_seconds']:.0f}",
                     "—" if frozen is None else f"{pct(frozen['match']['attainment'])} · "
                                                f"{frozen['match']['replica_seconds']:.0f}",
                     "—" if frozen is None else f"**{pct(frozen['saving'])}**"])
    return table(["seed", "coordinated: attainment · replica-s", "knobs only (1 replica)",
                  "replicas only at 2048/2048: best target", "replicas only at frozen tuned knobs: cheapest target "
                  "at the same attainment", "coordinated saves"], rows) + [
        "", f"Medians: coordinated {pct(t['coordinated_attainment'])}, knobs only {pct(t['knobs_attainment'])}, "
            f"replicas only at 2048/2048 {pct(t['replicas_start-up_attainment'])}; coordinated saves "
            f"{pct(t['saving_vs_tuned-once'])} of the replica-seconds against the frozen tuned knobs (target ≥ 20 %: "
            f"met in {t['targets_met_vs_tuned-once']} of {len(d['per_seed'])} seeds)."]


def _timings(d: dict, phases: dict[str, str], closing: str) -> list[str]:
    """Median and per-run seconds of each phase a cluster benchmark timed, and what the runs passed."""
    runs = d["runs"]
    def s(v: float) -> str:  # sub-second phases (a push) need their hundredths
        return f"{v:.2f}" if v < 1 else f"{v:.1f}"
    rows = [[label, f"**{s(d['medians'][k])} s**", ", ".join(s(r[k]) for r in runs if k in r)]
            for k, label in phases.items() if k in d["medians"]]
    return table(["", "median", "runs"], rows) + ["", f"{sum(r['passed'] for r in runs)} of {len(runs)} {closing}"]


def local_cluster(d: dict) -> list[str]:
    return _timings(d, {
        "apply_to_scheduled_s": "apply → scheduled", "apply_to_ready_s": "apply → Ready (startup probe)",
        "apply_to_first_token_s": "apply → first token through the Service",
        "status_to_configmap_s": "tuner's knobs in status → ConfigMap (the durable copy)",
        "write_to_engine_s": "tuner's knobs in status → engine applied (the operator's push)",
        "write_to_ack_s": "tuner's knobs in status → every pod's acknowledgement in status.knobs",
        "configmap_to_engine_s": "ConfigMap → engine applied (the kubelet's volume sync; runs before the push)",
        "delete_to_pod_deletion_s": "delete → the pod's own deletion (Kubernetes' garbage collector: the "
                                    "Deployment, its ReplicaSet, then the pod)",
        "delete_to_pod_gone_s": "delete → pod gone (the cascade, then preStop and drain)",
        "container_kill_to_current_knobs_s": "engine container killed → restarted, running the current knobs",
        "configmap_invalid_json_to_put_back_s": "knobs ConfigMap edited by hand to invalid JSON → put back by the operator (the pod keeps the decided knobs)",
        "configmap_out_of_bounds_to_put_back_s": "… to knobs outside the engine's bounds → the same",
        "configmap_undecided_to_put_back_s": "… to valid knobs nobody decided → the same",
        "broken_model_to_status_s": "apply of a truncated model → its load error in Ready, Degraded and an Event",
        "unreadable_model_to_status_s": "apply of a model folder the engine's user may not read → the same",
        "operator_kill_to_reconciled_s": "operator SIGKILLed and restarted → a spec change made after observed "
                                         "(streamed load through the Service all along: no request failed)",
        "tuner_kill_to_status_s": "tuner SIGKILLed and restarted → its status written again",
        "prometheus_back_to_tuning_s": "Prometheus stopped until the tuner held, started → Tuning True again",
        "apiserver_outage_s": "API server and etcd stopped 30 s: unavailable from the kill until ready again",
        "apiserver_back_to_both_controllers_s": "… then → the operator observes a spec change and the tuner writes "
                                                "status (no restart of either)"},
        "runs passed every check of `tests/cluster/test_real_pods.py` (apply, tune, delete), each on a fresh "
        "cluster. Each phase is timed by polling every 0.05 s, each read stamped at its midpoint, so a phase shorter "
        "than one poll cycle (the push: a few API calls and one HTTP request) reads as under 0.15 s. Before the push (issue 36) a knob change waited for the kubelet's periodic pod sync "
        "(`syncFrequency`, 1 min by default, plus jitter): 66 s median (53-72 s) over three runs.") + faults_table(d)


FAULTS = {  # timing key: the fault, as issue 37 names it (recovery measured from the fault's end)
    "operator_kill_to_reconciled_s": "operator SIGKILLed mid-work, restarted",
    "tuner_kill_to_status_s": "tuner SIGKILLed, restarted",
    "prometheus_back_to_tuning_s": "Prometheus stopped until the tuner held, then back",
    "apiserver_back_to_both_controllers_s": "API server and etcd stopped for 30 s, then back",
    "container_kill_to_current_knobs_s": "engine container SIGKILLed (the kubelet restarts it)",
    "configmap_invalid_json_to_put_back_s": "knobs ConfigMap edited to invalid JSON",
    "configmap_out_of_bounds_to_put_back_s": "knobs ConfigMap edited to knobs out of bounds",
    "configmap_undecided_to_put_back_s": "knobs ConfigMap edited to knobs nobody decided",
    "broken_model_to_status_s": "a model that fails to load (truncated weights)",
    "unreadable_model_to_status_s": "a model folder the engine may not read",
}
UNDER_LOAD = ("operator_kill_to_reconciled_s", "tuner_kill_to_status_s", "prometheus_back_to_tuning_s",
              "apiserver_back_to_both_controllers_s")


def faults_table(d: dict) -> list[str]:
    """Issue 37's table from the same runs: per fault, what clients saw, the recovery, and what was lost (each run
    passed only if its test found nothing lost: no trial, no undecided knobs, no duplicate object)."""
    runs, medians = d["runs"], d["medians"]
    served = [r["faults_requests_served"] for r in runs if "faults_requests_served" in r]
    failed = [r["faults_requests_failed"] for r in runs if "faults_requests_failed" in r]
    rows = []
    for key, fault in FAULTS.items():
        if key not in medians:
            continue
        if key == "apiserver_back_to_both_controllers_s" and any("outage_requests_served" in r for r in runs):
            o_served = sum(r.get("outage_requests_served", 0) for r in runs)
            o_failed = [r.get("outage_requests_failed", 0) for r in runs]
            clients = (f"{int(sum(o_failed))} failed of {int(o_served)} streamed" +
                       (f" (in {sum(1 for f in o_failed if f)} of {len(runs)} runs, while Kubernetes had marked the "
                        f"node not ready: the heartbeat gap, outage plus restart, passed the 50-s grace)"
                        if sum(o_failed) else ""))
        else:
            clients = (f"{int(sum(failed))} failed of {int(sum(served))} streamed" if key in UNDER_LOAD and served
                       else "no traffic reaches the pod" if key.endswith("model_to_status_s") else "not under load")
        lost = "none" if all(r["passed"] for r in runs) else "see the failed run"
        rows.append([fault, clients, f"{medians[key]:.1f} s", lost])
    if not rows:
        return []
    return ["", "Faults (issue 37; the four under load ran one after another with streamed requests through the "
                "Service all along, counted over all of them):", ""] + \
        table(["fault", "client requests", "back (median)", "state lost"], rows)


def helm_install(d: dict) -> list[str]:
    return _timings(d, {
        "install_to_ready_s": "`helm install --wait` → operator and tuner Ready",
        "apply_to_first_token_s": "apply the InferenceDeployment → first token through its Service",
        "install_to_first_token_s": "`helm install` → first token (install, `helm test`, apply)",
        "install_to_tuned_knobs_s": "`helm install` → the tuner pod's first knobs applied by the engine"},
        "runs passed every check of `tests/cluster/test_helm_install.py` (a failed install, install, `helm test`, "
        "scrape through the ServiceMonitor, a tuned trial, upgrade, rollback, uninstall, reinstall). The tuned "
        "knobs wait for Prometheus to scrape the new pod, for the tuner's first pick and for the kubelet's "
        "ConfigMap volume sync (about a minute).")


def controllers_scale(d: dict) -> list[str]:
    rows = []
    for size in d["sizes"]:
        for name in ("operator", "tuner"):
            c = size[name]
            rpm = c["requests_per_minute"]
            verbs = ", ".join(f"{v} {x:.0f}" for v, x in rpm["by_verb"].items())
            rows.append([str(size["resources"]), name, f"**{c['all_reconciled_s']:.1f} s**",
                         f"**{rpm['total']:.0f}** ({verbs or 'none'})",
                         f"{rpm['total'] / size['resources']:.1f}", f"{c['peak_rss_mib']:.0f} MiB",
                         f"{c['rss_end_mib']:.0f} MiB", str(c["threads"])])
    out = table(["resources", "controller", "all reconciled (from start)", "API requests/min, steady",
                 "per resource", "peak RSS", "RSS at the end", "threads"], rows)
    g = d.get("growth")
    if g:
        out += ["", f"From {d['sizes'][0]['resources']} to {d['sizes'][-1]['resources']} resources "
                    f"({times(g['operator']['resources'], 0)}): the operator's steady requests "
                    f"{times(g['operator']['requests_per_minute'])} and its peak RSS "
                    f"{times(g['operator']['peak_rss'])}; the tuner's "
                    f"{times(g['tuner']['requests_per_minute'])} and {times(g['tuner']['peak_rss'])}."]
    first = d["sizes"][0]
    return out + ["", f"Both controllers as the chart's ServiceAccounts on the real API server "
                      f"(`tests/control_plane.py`; no kubelet, so no pod runs and no engine is scraped: every tuner "
                      f"thread holds, retrying 2 s doubling to 60 s). Steady state: {first['steady_s']:.0f} s of the "
                      f"API server's audit log by user, {first['settle_s']:.0f} s after all were reconciled, so one "
                      f"300-s operator resync is in it. The operator's requests are its passes after the tuner's "
                      f"status writes (a fresh read of the resource and its children) and its resync."]


def quantization(d: dict) -> list[str]:
    def name(r: dict) -> str:
        return r["method"] + (" `--compile`" if r.get("compile") else "")

    rows = [[name(r), f"{r['decode_ms_per_token']:.1f} ms (**{times(r['decode_speedup'])}**)",
             f"{r['prefill_512_s']:.2f} s ({times(r['prefill_speedup'])})", f"{r['batch16_tokens_per_s']:.0f}",
             f"{r['weight_bytes'] / 2**20:.0f} MiB ({pct(r['weights_ratio'])})",
             f"{r['perplexity']:.3f} (**{r['perplexity_ratio']:.4f}×**)", pct(r["greedy_agreement"]),
             f"{r['startup_s']:.0f} s" if "startup_s" in r else "—"]
            for r in d["rows"]]
    peer = d.get("llama_cpp")
    failed = peer.get("error") if peer else None
    if failed:
        rows.append([peer["method"], f"failed: {failed}", "—", "—", "—", "—", "—", "—"])
        peer = None
    elif peer:
        runs = peer.get("runs_ms_per_token", [])
        rows.append([peer["method"], f"{peer['decode_ms_per_token']:.1f} ms"
                     + (f" (runs before and after: {' and '.join(f'{x:.1f}' for x in runs)})" if len(runs) > 1 else ""),
                     "—", "—", "—", "—", "—", "—"])
    out = table(["weights", "batch-1 decode, ms/token (vs float32, same mode)", "512-token prefill",
                 "batch 16, tokens/s", "weights held", "perplexity (vs float32)", "greedy agreement with float32",
                 "start-up"], rows)
    notes = []
    for compiled in sorted({bool(r.get("compile")) for r in d["rows"]}):
        by = {r["method"]: r for r in d["rows"] if bool(r.get("compile")) == compiled}
        mode = "compiled" if compiled else "eager"
        if "int8" in by:
            notes.append(f"{mode}: int8 decode {times(by['int8']['decode_speedup'])} float32's (target ≥ 2×: "
                         f"{verdict(by['int8']['decode_speedup'] >= 2)})")
        if "int4" in by and peer:
            notes.append(f"{mode}: int4 decode {by['int4']['decode_ms_per_token']:.1f} against llama.cpp's "
                         f"{peer['decode_ms_per_token']:.1f} ms/token (target at or below: "
                         f"{verdict(by['int4']['decode_ms_per_token'] <= peer['decode_ms_per_token'])})")
    by = {r["method"]: r for r in d["rows"] if not r.get("compile")}
    if "int8" in by:
        notes.append(f"int8 perplexity {pct(by['int8']['perplexity_ratio'] - 1, 2)} higher (target ≤ 2 %: "
                     f"{verdict(by['int8']['perplexity_ratio'] <= 1.02)})")
    if "int4" in by:
        notes.append(f"int4 perplexity {pct(by['int4']['perplexity_ratio'] - 1, 2)} higher (target ≤ 8 %: "
                     f"{verdict(by['int4']['perplexity_ratio'] <= 1.08)})")
    if not peer:
        notes.append(f"llama.cpp not measured in this run ({'it failed: ' + failed if failed else 'llama-cpp-python not installed'})")
    slower = [name(r) for r in d["rows"] if r["prefill_speedup"] < 1]
    notes.append("prefill no slower than float32: " + verdict(not slower))
    return out + ["", "; ".join(notes) + "."]


def speculative(d: dict) -> list[str]:
    rows = []
    for r in d["rows"]:
        on, off = r["on"], r["off"]
        acc = pct(on["acceptance"]) if on["acceptance"] is not None else "no drafts"
        rows.append([r["workload"], str(r["batch"]), f"{off['tokens_per_s']:.1f} → {on['tokens_per_s']:.1f} "
                     f"(**{times(r['speedup'])}**)", f"{off['itl_ms']:.1f} → {on['itl_ms']:.1f} ms",
                     f"{on['draft_tokens']}, {acc} kept", ", ".join(str(k) for k in on["accepted_per_position"]),
                     "yes" if r["outputs_equal"] else "**no**"])
    out = table(["workload", "batch", "tokens/s, drafts off → on", "ITL, off → on", "draft tokens",
                 "kept by position", "outputs equal"], rows)
    by = {(r["workload"], r["batch"]): r["speedup"] for r in d["rows"]}
    rep, fresh = by.get(("repeats the prompt", 1)), [v for (w, _), v in by.items() if w == "does not repeat"]
    notes = []
    if rep is not None:
        notes.append(f"outputs that repeat the prompt, batch 1: {times(rep)} (target ≥ 1.5×: {verdict(rep >= 1.5)})")
    if fresh:
        notes.append(f"outputs that do not, the worst batch: {times(min(fresh))} (target ≥ 0.95×: "
                     f"{verdict(min(fresh) >= 0.95)})")
    return out + ["", "; ".join(notes) + "."]


def kv_transfer(d: dict) -> list[str]:
    rows = [[str(r["tokens"]), f"{r['bytes'] / 2**20:.1f}", f"{r['nixl_s'] * 1000:.1f} ({r['nixl_gbps']:.2f} GB/s)",
             f"{r['checksum_s'] * 1000:.1f}", f"{r['copy_s'] * 1000:.1f}"] for r in d["rows"]]
    return table(["prompt tokens", "MiB", "NIXL read, ms", "checksums, ms", "local copy, ms"], rows)


def pull_contention(d: dict) -> list[str]:
    rows = d["rows"]
    alone = next(r for r in rows if r["worst_step_p50_s"] is None)
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    out = table(["pull", "step p50, ms", "step p99, ms", "p99 / p99 alone", "longest step beside a pull, ms "
                 "(median, max)", "the pull, ms"],
                [[r["arm"], ms(r["step_p50_s"]), ms(r["step_p99_s"]), f"{r['step_p99_s'] / alone['step_p99_s']:.2f}x",
                  "-" if r["worst_step_p50_s"] is None else f"{ms(r['worst_step_p50_s'])}, {ms(r['worst_step_max_s'])}",
                  ms(r["pull_p50_s"])] for r in rows])
    c = d["conditions"]
    return out + ["", f"A {c['tokens']}-token prompt's blocks pulled once every {c['every_s']:g} s beside {c['seqs']} "
                      f"decoding sequences, on core(s) {c['cores']}, {c['pulls']} pulls an arm in each of "
                      f"{c['rounds']} rounds."]


def routing(d: dict) -> list[str]:
    c, traces, ratios = d["conditions"], d["traces"], d["ratios"]
    names = {"service": "through the Service (random)", "gateway": "through Envoy and the endpoint picker"}
    rows = [[kind, names[name], f"{a['ttft_p50_s']:.2f}", f"{a['ttft_p90_s']:.2f}", f"{a['output_tokens_per_s']:.1f}",
             pct(a["prefix_hit_rate"]), ", ".join(f"{n:g}" for n in a["per_pod_requests"]), str(a["failed"])]
            for kind, arms in traces.items() for name, a in arms.items()]
    out = table(["trace", "arm", "TTFT p50, s", "TTFT p90, s", "output tokens/s", "prefix-cache hits",
                 "requests per pod", "failed"], rows)
    shared, unique = ratios["shared"], ratios["unique"]
    return out + ["", f"Shared prefixes: p90 TTFT **{shared['ttft_p90_service_over_gateway']:.2f}x lower** through "
                      f"the picker (target ≥ 3x), output tokens/s **{shared['tokens_per_s_gateway_over_service']:.2f}x** "
                      f"(target ≥ 1.3x); no shared prefix: output tokens/s "
                      f"**{unique['tokens_per_s_gateway_over_service']:.2f}x** (target ≥ 0.97x). {c['pods']} engine pods "
                      f"on the local cluster's node (two cores), KV cache {c['kv_gb']:g} GB each; {c['tenants']} "
                      f"tenants with {c['prefix_words']}-word system prompts; shared: {c['requests']} requests per arm "
                      f"and round at {c['rate']:g}/s, unique: {c.get('unique_requests', c['requests'])} at "
                      f"{c.get('unique_rate', c['rate']):g}/s (Poisson), {c['max_tokens']} output tokens; "
                      f"{c['rounds']} rounds, arms alternating, fresh prompts per arm on one arrival schedule."]


def _why(rung: dict) -> str:
    """Which SLO a rung's misses broke and the first inter-token gap apart from the rest (runs before these were
    recorded have none)."""
    if "missed_ttft" not in rung:
        return "not recorded"
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    return (f"{rung['missed_ttft']} / {rung['missed_itl']}; {ms(rung['first_gap_p50'])}, "
            f"{ms(rung['later_gap_p99'])}")


def disaggregation(d: dict) -> list[str]:
    c = d["conditions"]
    out = [f"SLOs from this machine's speed: TTFT ≤ {c['slo_ttft']:.1f} s (a lone 1024-token prompt: "
           f"{c['ttft_1024']:.2f} s), each request's p99 ITL ≤ {c['slo_itl'] * 1000:.0f} ms (a lone decode: "
           f"{c['itl_alone'] * 1000:.0f} ms per token); goodput: the highest rate with ≥ 90 % of requests within "
           "both.", ""]
    for trace, t in d["traces"].items():
        rows = [[name, a["kind"], str(a["knob"]), f"{a['goodput']:g}/s",
                 ", ".join(f"{r['rate']:g}/s: {pct(r['within_slo'])}" for r in a["ladder"]), _why(a["ladder"][-1])]
                for name, a in t["arms"].items()]
        out += [f"**{trace}**", ""] + table(["arm", "kind", "chunk or threshold", "goodput", "within SLOs by rate",
                                            "last rate: missed TTFT / ITL; first gap p50, later gaps p99"], rows)
        ratio, auto = t["split_vs_best_colocated"], t["auto_in_hindsight_vs_best_colocated"]
        target = ("split ≥ 1.2× the best colocated" if trace == "prefill_heavy"
                  else "auto (the better of the two, chosen in hindsight here) ≥ 0.97×")
        value = ratio if trace == "prefill_heavy" else auto
        out += ["", f"{trace}: split {times(ratio) if ratio is not None else 'n/a (colocated met the SLOs at no rate)'} "
                    f"the best colocated; target {target}: "
                    + (verdict(value >= (1.2 if trace == "prefill_heavy" else 0.97)) if value is not None
                       else "not measured") + ".", ""]
        ph = t.get("split_ttft_phases") or {}
        if ph.get("remote_prefill"):
            out += [f"The split's TTFT at its goodput rate, by phase (mean): queue {ph['queue']:.2f} s, remote prefill "
                    f"{ph['remote_prefill']:.2f} s, transfer {ph['transfer']:.3f} s (its share of the prefill "
                    f"{pct(ph.get('transfer_share_of_prefill'))}); {ph['transfers_ok']:g} transfers, "
                    f"{ph['fallbacks']:g} local fallbacks.", ""]
    return out


def disaggregation_predicted(d: dict) -> list[str]:
    c = d["conditions"]
    what_if = [f"+{c.get('pull_overhead')} s a pull"] if c.get("pull_overhead") else []
    out = [f"The simulator (`sim/split.py`) on the bench's own requests and knobs, with the SLOs and lone-request "
           f"figures of the measured run of {c['measured_run']} (commit {c['measured_commit']}). Step cost: "
           f"{c['step_cost']}. Transfer: {c['transfer']}."
           + (f" What-if: {'; '.join(what_if)}." if what_if else " The engine as it is (no what-if)."), ""]
    for trace, t in d["traces"].items():
        p, measured = t["predicted"], t.get("measured") or {}
        rows = []
        for name, a in p["arms"].items():
            m = measured.get(name)
            rows.append([name, f"{a['goodput']:g}/s",
                         ", ".join(f"{r['rate']:g}/s: {pct(r['within_slo'])}" for r in a["ladder"]),
                         _why(a["ladder"][-1]), f"{m['goodput']:g}/s" if m else "not run",
                         ", ".join(f"{r['rate']:g}/s: {pct(r['within_slo'])}" for r in m["ladder"]) if m else ""])
        out += [f"**{trace}**", ""] + table(["arm", "predicted goodput", "predicted within SLOs by rate",
                                             "predicted last rate: missed TTFT / ITL; first gap p50, later gaps p99",
                                             "measured goodput", "measured within SLOs by rate"], rows)
        ratio = p["split_vs_best_colocated"]
        # predictions made before the split ran with each --first-token have no best per mode
        by_first = "; ".join(f"best split with --first-token {f}: {n}, {p['arms'][n]['goodput']:g}/s"
                             for f, n in (p.get("best_split_by_first_token") or {}).items())
        out += ["", f"{trace}: predicted best {p['best_colocated']} and {p['best_split']}, split "
                    f"{times(ratio) if ratio is not None else 'n/a (colocated meets the SLOs at no rate)'} the best "
                    "colocated" + (f"; {by_first}" if by_first else "") + ".", ""]
    return out


def slo_classes(d: dict) -> list[str]:
    c, rates, arms, v = d["conditions"], d["rates"], d["arms"], d["verdict"]
    rows = []
    for name, ladder in arms.items():
        rows.append([name] + [pct(r["interactive_within_slo"])
                              + (f" [{pct(r['interactive_within_slo_engine'])}]"
                                 if "interactive_within_slo_engine" in r else "")
                              + (f" ({pct(r['predicted']['interactive_within_slo'])})" if "predicted" in r else "")
                              + f", {r['batch_tokens_per_s']:.1f}"
                              + (f", {r['batch_past_deadline']} late" if r["batch_past_deadline"] else "")
                              for r in ladder])
    out = table(["arm"] + [f"{r:g}/s" for r in rates], rows)
    at, t = v.get("at_fcfs_80"), v["targets"]
    out += ["", "Each cell: interactive requests within both SLOs as the client timed each token [as the engine "
                "counted them, where it did] (beside a measurement, the simulator's prediction), "
                "batch output tokens/s, "
                "batch requests past their deadline. "
                f"Interactive TTFT ≤ {c['slo']['ttft']:g} s and each request's p99 gap ≤ {c['slo']['itl']:g} s; "
                f"{c['seconds']:g} s of Poisson arrivals a rate, the same requests for every arm; FCFS at the knob "
                f"pairs {', '.join(f'{b}/{k}' for b, k in c['grid'])}, the best in hindsight per rate."]
    if at:
        out += ["", f"At {at['rate']:g}/s, where FCFS's best ({at['fcfs_arm']}) kept {pct(at['fcfs_interactive'])} of "
                    f"interactive requests: classes {pct(at['classes_interactive'])} (target ≥ 99 %: "
                    f"{verdict(t['interactive_99_at_fcfs_80'])}), batch throughput {times(at['batch_throughput_ratio'])}"
                    f" FCFS's (target ≥ 0.9×: {verdict(t['batch_throughput_90'])}), "
                    f"{at['classes_batch_past_deadline']} batch requests past their deadline "
                    f"({verdict(t['no_batch_past_deadline'])})."]
    ratio = v["sustainable_ratio"]
    out += ["", f"The highest rate with ≥ 99 % interactive within: classes {v['sustainable_classes']:g}/s, FCFS "
                f"{v['sustainable_fcfs']:g}/s" + (f", {times(ratio)}" if ratio else "") +
                f" (target ≥ 1.3×: {verdict(t['sustainable_1_3x'])}); at {v['top_rate']:g}/s "
                f"{v['violations_ratio_at_top']:.1f}× fewer interactive violations (target ≥ 10×: "
                f"{verdict(t['violations_10x_at_top'])})."]
    return out


@dataclass(frozen=True)
class Section:
    name: str  # bench/results/NAME.json (and NAME.png)
    title: str
    command: str
    render: Callable[[dict], list[str]]


SECTIONS = (
    Section("demo_runs", "The demo, three times in a row with its defaults", "python bench/demo_runs.py --runs 3",
            demo_runs),
    Section("demo_runs_busy", "The demo, three times in a row with a busy minute during its first check",
            "python bench/demo_runs.py --runs 3 --busy 60", demo_runs),
    Section("tuner_vs_grid", "Tuner against an exhaustive grid, model-guided and black-box (simulator)",
            "python bench/tuner_vs_grid.py --seeds 30", _tuner_scenarios),
    Section("tuner_vs_grid_model", "Tuner against the grid, model-guided, the latest tuner (simulator)",
            "python bench/tuner_vs_grid.py --guidance model --out tuner_vs_grid_model", _tuner_scenarios),
    Section("tuner_vs_grid_contention", "Tuner against the grid under contention noise (simulator)",
            "python bench/tuner_vs_grid.py --guidance model --contention 1.0 --out tuner_vs_grid_contention",
            _tuner_scenarios),
    Section("autoscale", "Replicas as the last knob, on a 1 → 3 → 1 ramp (simulator)",
            "python bench/autoscale.py --seeds 3", autoscale),
    Section("quantization", "Weight-only quantization", "python bench/quantization.py", quantization),
    Section("speculative", "Speculative decoding (n-gram drafts)", "python bench/speculative.py", speculative),
    Section("kv_transfer", "Moving a prompt's KV blocks (NIXL)", "python bench/kv_transfer.py", kv_transfer),
    Section("pull_contention", "What a pull costs the decode steps beside it (one core)",
            "python bench/pull_contention.py --seqs 2 --shares 0.25,0.1", pull_contention),
    Section("routing", "Prefix- and load-aware routing against the Service (local cluster)", "python bench/routing.py",
            routing),
    Section("slo_classes", "Per-request SLO classes against first come first served", "python bench/slo_classes.py",
            slo_classes),
    Section("slo_classes_predicted", "Per-request SLO classes predicted by the simulator",
            "python bench/slo_classes.py --predict-only", slo_classes),
    Section("disaggregation", "Prefill/decode disaggregation against the best colocated knobs",
            "python bench/disaggregation.py --itl-x 3", disaggregation),
    Section("disaggregation_ladder", "Prefill/decode disaggregation: the best arms again on a lower ladder",
            "python bench/disaggregation.py --itl-x 3 --traces prefill_heavy --rates 0.05,0.1,0.15,0.2,0.3 --arms "
            "colocated-256,colocated-512,split-0-with-kv --out disaggregation_ladder", disaggregation),
    Section("disaggregation_predicted", "Prefill/decode disaggregation predicted by the simulator",
            "python bench/disaggregation.py --predict-only", disaggregation_predicted),
    Section("predictor_vs_sim", "The step-time predictor against the simulator", "python bench/predictor_vs_sim.py",
            predictor_vs_sim),
    Section("sim_accuracy", "The simulator against the real server", "python bench/sim_accuracy.py", sim_accuracy),
    Section("stall", "Stall-free chunked prefill", "python bench/stall.py --long 3", stall),
    Section("chunk_overhead", "Chunked prefill's overhead", "python bench/chunk_overhead.py", chunk_overhead),
    Section("roofline", "Roofline", "python bench/roofline.py", roofline),
    Section("vs_transformers", "Against transformers", "python bench/vs_transformers.py", vs_transformers),
    Section("tensor_parallel", "Tensor parallelism", "python bench/tensor_parallel.py", tensor_parallel),
    Section("local_cluster", "One node, real kubelet: first-day timings", "python bench/local_cluster.py --runs 3",
            local_cluster),
    Section("helm_install", "helm install on a real node", "python bench/local_cluster.py --suite helm --runs 3",
            helm_install),
    Section("controllers_scale", "Operator and tuner with 20 and 200 InferenceDeployments (real API server)",
            "python bench/controllers_scale.py", controllers_scale),
)


def page(results: Path = RESULTS) -> str:
    out = ["# Results", "",
           "<!-- generated by `python bench/results_page.py` from bench/results/*.json: do not edit by hand -->", "",
           "Every figure here is read from a file under `bench/results/`, written by the command above it, with the "
           "conditions it ran under. Benchmarks are not tests: each measures its ratio side by side in one run "
           "(this shared machine moves by about ±10 % between runs). `bash bench/run_all.sh` runs them all; "
           "`bench/gpu_check.sh` is the prepared GPU run.", ""]
    out += [f"- [{s.title}](#{anchor(s.title)})" for s in SECTIONS if (results / f"{s.name}.json").exists()]
    gpu = [s for s in SECTIONS if (results / "gpu" / f"{s.name}.json").exists()]
    if gpu:
        out += [f"- [{GPU_TITLE}](#{anchor(GPU_TITLE)})"]
    for s in SECTIONS:
        out += _section(s, results, "", "##", s.command)
    if gpu:
        out += ["", f"## {GPU_TITLE}", "", GPU_INTRO]
        for s in gpu:
            out += _section(s, results, "gpu/", "###", "bash bench/gpu_check.sh", " (GPU)")
    return "\n".join(out) + "\n"


GPU_TITLE = "On a GPU"
GPU_INTRO = ("`bench/gpu_check.sh` on the device machine: the same benchmarks on CUDA in bfloat16, on a random-weight "
             "model at Llama-3-8B's size made there (`bench/make_model.py`; random weights cost what real ones "
             "cost), with GPU-sized settings. Its figures land under `bench/results/gpu/`.")


def _section(s: Section, results: Path, sub: str, level: str, command: str, suffix: str = "") -> list[str]:
    path = results / sub / f"{s.name}.json"
    if not path.exists():
        return []
    d = json.loads(path.read_text())
    out = ["", f"{level} {s.title}{suffix}", "", f"`{command}` → `bench/results/{sub}{s.name}.json`", "",
           measured_on(d.get("conditions", {}))]
    extra = settings(d.get("conditions", {}))
    if extra:
        out += ["", extra]
    out += [""] + s.render(d)
    if (results / sub / f"{s.name}.png").exists():
        out += ["", f"![{sub}{s.name}](../bench/results/{sub}{s.name}.png)"]
    return out


def headline(results: Path = RESULTS) -> str:
    """The README's headline: the demo's latest runs, read from demo_runs.json."""
    d = json.loads((results / "demo_runs.json").read_text())
    runs = d["runs"]
    att = ", ".join(f"**{pct(r['attainment']['tuned'])} vs {pct(r['attainment']['fixed'])}**" for r in runs)
    good = ", ".join(f"**{times(r['goodput']['ratio'])}**" for r in runs)
    return (f"The latest {len(runs)} runs in a row (`python bench/demo_runs.py --runs {len(runs)}`, "
            f"{d['conditions'].get('time', '?')}): tuned vs fixed SLO attainment {att}; goodput {good}. Every "
            "figure, with its conditions: [docs/results.md](docs/results.md).\n")


def readme(text: str, results: Path = RESULTS) -> str:
    """`text` (the README) with its headline block regenerated."""
    if not HEADLINE.search(text):
        raise ValueError("README.md has no <!-- results:headline --> block")
    return HEADLINE.sub(lambda m: m.group(1) + headline(results) + m.group(3), text)


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/results.md differs from the files")
    args = p.parse_args(argv)
    wanted = {PAGE: page(), README: readme(README.read_text())}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} is not what bench/results/ says: run python bench/results_page.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
