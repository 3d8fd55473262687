"""The demo, start to end: two groups of SmolLM2 engines on the CPU get identical copies of one shifting workload;
one group keeps vLLM's default start-up knobs, the other is tuned online by the real tuner in local mode through
a local Prometheus. Side by side in one run, so the comparison is fair on a shared, noisy machine."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.stats import RequestRecord, meets
from chunkpilot.loadgen.workloads import Phase, Shape, build_workload, scaled
from chunkpilot.lab import PrometheusServer
from chunkpilot.tuner import Knobs, SearchSpace, TunerLoop, TunerSettings, TuningConfig, build_local

from chunkpilot.demo.engines import EngineProcess

log = logging.getLogger(__name__)
GROUPS = ("tuned", "fixed")
# Prometheus, the load generator and the tuner run at this niceness: below the engines, whose step times are what
# the demo measures and the tuner models.
HELPERS_NICE = 5
# The engines' and the tuner's settings, one place for the run and the report's hindsight replay of it.
MAX_NUM_SEQS = 16
KNOB_BOUNDS = (32, 2048)  # token budget and max chunk alike
# CPU-sized shapes: chat as usual, long prompts scaled to what one core prefills in about a second.
SHAPES = {"chat": Shape(prompt=(16, 96), output=(8, 32)), "rag": Shape(prompt=(256, 1024), output=(8, 32))}


def _longer(shape: Shape, output_scale: float) -> Shape:
    lo, hi = shape.output
    return Shape(shape.prompt, (max(1, round(lo * output_scale)), max(1, round(hi * output_scale))))


@dataclass(frozen=True)
class DemoConfig:
    model: str
    out: Path
    duration: float = 360.0
    replicas: int = 1  # engines per group
    rate: float = 0.5  # requests/s per engine at the busiest phase
    start: Knobs = Knobs(2048, 2048)  # vLLM's API-server default budget, unchunked
    # p99 seconds: long enough that a 1024-token prompt queued behind another at the busiest rate is still served
    # in time on a slow 2-core host (the ITL SLO, not this one, is what the start-up knobs break).
    ttft_slo: float = 12.0
    itl_slo: float = 0.5  # p99 seconds
    window: float = 20.0
    warmup: float = 3.0
    max_trials: int = 6
    threads: int = 1  # torch threads per engine (2 groups share the machine)
    seed: int = 0
    size_to_host: bool = True  # size outputs and long prompts to this machine (chunkpilot.demo.sizing)
    rag_scale: float = 1.0  # the long prompts' length against SHAPES (what the sizing chose)
    output_scale: float = 1.0  # every stream's output length against SHAPES (what the sizing chose)
    probe_rounds: int = 4  # at most this many rounds of the probe (chunkpilot.demo.probe)
    check_seconds: float = 40.0  # the measured check's length at the busiest rate (chunkpilot.demo.check)
    sizing_seconds: float = 300.0  # the checks' time bound (chunkpilot.demo.sizing.size)
    force: bool = False  # run the load even when the sizing did not pass its check
    cores: tuple[int, ...] | None = None  # the cores the engines share out (None: this process's affinity)
    quantization: str | None = None  # both groups' engines' --quantization (chunkpilot.engine.model.quantization)

    def shapes(self, rag_scale: float | None = None) -> dict[str, Shape]:
        scale = self.rag_scale if rag_scale is None else rag_scale
        return {"chat": _longer(SHAPES["chat"], self.output_scale),
                "rag": _longer(scaled(SHAPES["rag"], scale, None), self.output_scale)}

    def phases(self) -> list[Phase]:
        """Rate and mix shift: a calm quarter of chat, half the run busy with long prompts, a calm quarter."""
        quarter = self.duration / 4
        return [Phase(quarter, self.rate * 0.6, {"chat": 0.9, "rag": 0.1}),
                Phase(2 * quarter, self.rate, {"chat": 0.7, "rag": 0.3}),
                Phase(self.duration - 3 * quarter, self.rate * 0.6, {"chat": 0.9, "rag": 0.1})]

    def slo(self) -> SLOTargets:
        """The one SLO the tuner tunes against and each group's requests are judged by."""
        return SLOTargets.p99(ttft=self.ttft_slo, itl=self.itl_slo)


@dataclass
class DemoRun:
    config: DemoConfig
    engines: dict[str, list[EngineProcess]] = field(default_factory=dict)
    prometheus: PrometheusServer | None = None
    tuner: TunerLoop | None = None
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)
    started: float = 0.0  # wall clock, for Prometheus ranges
    stop: threading.Event = field(default_factory=threading.Event)
    knobs_file: Path | None = None
    errors: list[str] = field(default_factory=list)
    sizing: object | None = None  # chunkpilot.demo.sizing.Sizing, when the load was sized to the host
    placement: dict[str, list[int]] = field(default_factory=dict)  # the cores each group's engines run on
    busy_contention: float | None = None  # the busy phase's steps against the probe fit (report.contention)
    run_busy: float | None = None  # other programs' share of the engines' CPU in the load (chunkpilot.demo.host)


def _engine_args(config: DemoConfig, knobs_file: Path | None) -> list[str]:
    args = ["--threads", str(config.threads), "--max-model-len", "2048", "--kv-cache-memory-gb", "0.5",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--token-budget", str(config.start.token_budget),
            "--max-chunk", str(config.start.max_chunk), "--no-enable-prefix-caching"]
    if config.quantization:
        args += ["--quantization", config.quantization]
    return args + (["--knobs-file", str(knobs_file)] if knobs_file else [])


def start(config: DemoConfig, say=print, stop: threading.Event | None = None) -> DemoRun:
    """Engines, Prometheus, tuner (not yet iterating). Raises with a clear message when a part cannot start.
    `stop` (set by Ctrl-C) ends the sizing early and is the run's stop event."""
    config.out.mkdir(parents=True, exist_ok=True)
    run = DemoRun(config, stop=stop or threading.Event())
    run.knobs_file = config.out / "knobs.json"
    run.knobs_file.unlink(missing_ok=True)
    try:
        run.placement = placement(config.cores)
        where = "; ".join(f"{g} on core{'s' * (len(c) > 1)} {','.join(map(str, c))}" for g, c in run.placement.items())
        say(f"starting {2 * config.replicas} engine processes (SmolLM2, CPU, {config.threads} thread each"
            f"{'; ' + where if where else '; one core: not pinned'})...")
        for group in GROUPS:
            cores = set(run.placement[group]) if run.placement else None
            run.engines[group] = [EngineProcess(config.model, f"{group}-{i}", config.out,
                                                *_engine_args(config, run.knobs_file if group == "tuned" else None),
                                                cores=cores)
                                  for i in range(config.replicas)]
        for e in (e for es in run.engines.values() for e in es):
            e.wait_ready()
        # Everything started from here on (Prometheus, and this process's load generator and tuner) yields to them.
        os.nice(HELPERS_NICE)
        say("starting Prometheus (1 s scrapes)...")
        run.prometheus = PrometheusServer(config.out / "prometheus", {
            f"chunkpilot-{g}": [e.url.removeprefix("http://") for e in run.engines[g]] for g in GROUPS}).start()
        if config.size_to_host:
            config = run.config = _size(run, config, say)
    except BaseException as e:
        shutdown(run)  # a part that failed to start leaves none of the others running
        if isinstance(e, SizingStopped):
            e.run = run
        raise
    storage = config.out / "study.db"
    storage.unlink(missing_ok=True)  # each demo starts a fresh study
    tuning = TuningConfig(
        deployment="demo/tuned", slo=config.slo(), budget_bounds=KNOB_BOUNDS, chunk_bounds=KNOB_BOUNDS,
        storage=f"sqlite:///{storage}", seed=config.seed,
        settings=TunerSettings(window=config.window, warmup=config.warmup, max_trials=config.max_trials,
                               min_requests=5, apply_timeout=20, poll=0.5, backoff_max=10))
    run.tuner = build_local(tuning, knobs_file=run.knobs_file, prometheus_url=run.prometheus.url,
                            selector='job="chunkpilot-tuned"', start=config.start,
                            status_file=config.out / "tuner-status.json", stop=run.stop)
    return run


class SizingStopped(RuntimeError):
    """The sizing did not pass its check: the demo stops before its load (the message says why and what to do).
    `run` is the stopped run (its processes already stopped), for save_stopped."""

    def __init__(self, message: str, run: DemoRun | None = None) -> None:
        super().__init__(message)
        self.run = run


def placement(cores: tuple[int, ...] | None = None) -> dict[str, list[int]]:
    """Each group's engines on half of `cores` (this process's affinity by default; none when there are fewer
    than two), so that one group's steps do not slow the other's."""
    usable = os.sched_getaffinity(0)
    if cores is not None and not set(cores) <= usable:
        raise ValueError(f"--cores {','.join(map(str, cores))}: this process may run only on cores "
                         f"{','.join(map(str, sorted(usable)))}")
    cores = sorted(usable if cores is None else set(cores))
    if len(cores) < 2:
        return {}
    half = len(cores) // 2
    return {"tuned": cores[:half], "fixed": cores[half:2 * half]}  # as many each: an odd core stays free


def engine_cores(placement: dict[str, list[int]]) -> set[int]:
    """The cores the engines run on, where other programs take time from them (chunkpilot.demo.host): their
    groups' cores, or, unpinned (fewer than two cores), this process's affinity, which they inherit."""
    return set().union(*placement.values()) or os.sched_getaffinity(0)


def _size(run: DemoRun, config: DemoConfig, say) -> DemoConfig:
    """Probe, size, check (chunkpilot.demo.sizing); the configured load when the probe fails or says too little.
    The tuned group is left at the start-up knobs, where the tuner starts."""
    from chunkpilot.demo import probe as probes
    from chunkpilot.demo.check import EngineCheck
    from chunkpilot.demo.host import Busy
    from chunkpilot.demo.sizing import Sizing, size
    from chunkpilot.tuner import FileActuator, PrometheusSource

    source = PrometheusSource(run.prometheus.url, 'job="chunkpilot-tuned"')
    runner = probes.EngineProbe([e.url for e in run.engines["tuned"]],
                                FileActuator(run.knobs_file, source, config.start), source.step_model, stop=run.stop)
    space = SearchSpace.from_bounds(KNOB_BOUNDS, KNOB_BOUNDS)
    say("probing the tuned group's engines (decode steps at 1, 4 and 16 sequences; prefill in 32-, 128- and "
        "512-token chunks and unchunked) until the step-time fit identifies every term...")
    stopped = None
    try:
        busy = Busy(engine_cores(run.placement))
        model, rounds = probes.probe(runner, MAX_NUM_SEQS, config.start, KNOB_BOUNDS[1], say=say,
                                     max_rounds=config.probe_rounds)
        probe_busy = busy.share()
        if model is None:
            say("the probe fitted no step-time model: keeping the configured lengths")
            return config
        terms = probes.describe(model, KNOB_BOUNDS[1], MAX_NUM_SEQS)
        say(f"step-time fit after {rounds} round{'s' * (rounds != 1)} ({model.steps:.0f} steps): {terms}; other "
            f"programs took {probe_busy:.0%} of the CPU meanwhile")
        check = EngineCheck({g: [e.url for e in run.engines[g]] for g in GROUPS}, runner.apply, run.prometheus.url,
                            model, seconds=config.check_seconds, cores=engine_cores(run.placement))
        config, run.sizing = size(config, model, space, check, say=say, bound=config.sizing_seconds, stop=run.stop,
                                  sizing=Sizing(model=model, rounds=rounds, terms=terms, probe_busy=probe_busy))
        if not run.sizing.passed and not run.stop.is_set():
            if not config.force:
                run.config = config  # what was checked last, for demo.json
                stopped = SizingStopped(run.sizing.stopped)
            else:
                say("the sizing did not pass; --force: the load runs anyway")
    except Exception as e:  # noqa: BLE001 - sizing is a refinement: the demo goes on with the configured load
        say(f"sizing failed ({type(e).__name__}: {e}): keeping the configured lengths")
        log.exception("sizing failed")
        return run.config
    finally:
        # the tuner starts from the start-up knobs, as the fixed group runs them, whatever the sizing did
        try:
            runner.apply(config.start, force=True)
        except Exception as e:  # noqa: BLE001 - said, and the tuner's own actuator writes the knobs again
            say(f"could not set the tuned group back to the start-up knobs ({type(e).__name__}: {e})")
    if stopped is not None:
        raise stopped
    return config


def _load_thread(run: DemoRun, group: str) -> threading.Thread:
    config = run.config
    # Identical arrivals and requests for both groups: the same seed.
    specs = build_workload(config.phases(), vocab_size=49152, seed=config.seed, shapes=config.shapes())

    def one_engine(engine: EngineProcess) -> list[RequestRecord]:
        cfg = BenchmarkConfig(base_url=engine.url, model="smollm2", requests=specs, progress=False, timeout=120)
        return asyncio.run(run_benchmark_async(cfg)).records

    def body() -> None:
        results: list[RequestRecord] = []
        threads, outs = [], {}
        for i, engine in enumerate(run.engines[group]):
            t = threading.Thread(target=lambda i=i, e=engine: outs.__setitem__(i, one_engine(e)), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        for i in sorted(outs):
            results.extend(outs[i])
        run.records[group] = results

    t = threading.Thread(target=body, name=f"load-{group}", daemon=True)
    t.start()
    return t


def drive(run: DemoRun, on_tick=None) -> None:
    """Send the load to both groups and let the tuner work until the workload ends or `run.stop` is set."""
    from chunkpilot.demo.host import Busy

    run.started = time.time()
    busy = Busy(engine_cores(run.placement))
    loads = [_load_thread(run, g) for g in GROUPS]

    def tune() -> None:
        while not run.stop.is_set():
            try:
                run.tuner.iterate()
            except Exception as e:  # noqa: BLE001 - the demo reports, never crashes half-way
                run.errors.append(f"tuner: {type(e).__name__}: {e}")
                log.exception("tuner iteration failed")
                run.stop.wait(2)

    tuner = threading.Thread(target=tune, name="tuner", daemon=True)
    tuner.start()
    while any(t.is_alive() for t in loads) and not run.stop.is_set():
        if on_tick:
            on_tick()
        time.sleep(1.0)
    run.run_busy = busy.share()
    run.stop.set()
    tuner.join(30)


def shutdown(run: DemoRun) -> None:
    run.stop.set()
    for e in (e for es in run.engines.values() for e in es):
        e.stop()
    if run.prometheus is not None:
        run.prometheus.stop()


def summary(run: DemoRun) -> dict:
    """Per group, from the load generator's own records: SLO attainment and goodput, over the same requests."""
    out = {}
    slo = run.config.slo()
    for group in GROUPS:
        recs = run.records.get(group, [])
        done = [r for r in recs if r.ok]
        met = sum(1 for r in done if meets(r, slo))
        span = (max(r.end for r in done) - min(r.start for r in recs)) if done else 0.0
        out[group] = {"requests": len(recs), "finished": len(done), "met_slo": met,
                      "attainment": met / len(recs) if recs else 0.0, "goodput": met / span if span else 0.0}
    return out


def save_stopped(run: DemoRun, why: str) -> Path:
    """demo.json for a demo the sizing stopped before its load: what it sized and measured, and why it stopped."""
    doc = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.config).items()},
           "stopped": why, "placement": run.placement,
           "sizing": run.sizing.to_dict() if run.sizing is not None else None,
           "pids": [e.proc.pid for es in run.engines.values() for e in es] +
                   ([run.prometheus.proc.pid] if run.prometheus and run.prometheus.proc else [])}
    path = run.config.out / "demo.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def save_json(run: DemoRun, extra: dict) -> Path:
    state = run.tuner.state if run.tuner else None
    doc = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.config).items()},
           "summary": summary(run), "placement": run.placement,
           "sizing": run.sizing.to_dict() if run.sizing is not None else None,
           "busy_contention": run.busy_contention, "run_busy": run.run_busy,
           "trials": [h.to_dict() for h in state.history] if state else [], "errors": run.errors,
           "pids": [e.proc.pid for es in run.engines.values() for e in es] +
                   ([run.prometheus.proc.pid] if run.prometheus and run.prometheus.proc else []), **extra}
    path = run.config.out / "demo.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path
