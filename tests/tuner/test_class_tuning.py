"""The tuner with per-request SLO classes (docs/slo-classes.md, "The tuner"): every non-sheddable class is a
constraint at its own SLOs, a sheddable one never is; the objective weighs the classes by priority; the status and
SLOMet report each class; and, on the simulator, the loop finds knobs that keep every class where judging all
requests at the tightest class's SLO would find none."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chunkpilot.api.types import ConditionType
from chunkpilot.contract.slo import SLOClass, SLOClasses, SLOTargets
from chunkpilot.tuner.measurement import (ClassWindow, Window, class_weights, class_windows, constraints, feasible,
                                          latency_constraints, objective_value, slo_met, window_of)
from chunkpilot.tuner.state import TunerState, conditions, dump, status_slo
from chunkpilot.tuner.space import Knobs

CLASSES = SLOClasses((
    SLOClass("interactive", 10, SLOTargets.p99(ttft=3.0, itl=0.5)),
    SLOClass("batch", 0, SLOTargets.p99(ttft=120.0, itl=5.0)),
    SLOClass("spare", -1, SLOTargets.p99(ttft=60.0)),
), "interactive")
SPEC_SLO = CLASSES.get("interactive").slo


def window(**by_class) -> Window:
    """A minute with 30 requests finished; each class's (ttft, itl, finished, met) as given, defaults all kept."""
    measured = {name: dict(ttft=v[0], itl=v[1], finished=v[2], met=v[3]) for name, v in by_class.items()}
    cw = class_windows(CLASSES, measured)
    done = sum(c.finished for c in cw)
    return Window(seconds=60, requests=int(done), request_rate=done / 60, output_tokens_per_s=100.0,
                  goodput=sum(c.met for c in cw) / 60, ttft=measured.get("interactive", {}).get("ttft"),
                  itl=measured.get("interactive", {}).get("itl"), classes=cw)


KEPT = dict(interactive=(1.0, 0.3, 20, 20), batch=(40.0, 1.0, 8, 8), spare=(30.0, 2.0, 2, 2))


def test_weights_rank_the_priorities():
    assert class_weights(CLASSES) == {"interactive": 3.0, "batch": 2.0, "spare": 1.0}
    same = SLOClasses((SLOClass("a", 5), SLOClass("b", 5), SLOClass("c", 7)), "a")
    assert class_weights(same) == {"a": 1.0, "b": 1.0, "c": 2.0}


def test_each_non_sheddable_class_is_a_constraint_at_its_own_slos():
    ok = window(**KEPT)
    # the batch class's 40-s TTFT is no breach of the interactive 3 s: each class has its own thresholds
    assert latency_constraints(ok, SPEC_SLO) == pytest.approx([1 / 3 - 1, 0.3 / 0.5 - 1, 40 / 120 - 1, 1 / 5 - 1])
    assert slo_met(ok, SPEC_SLO) and feasible(ok, SPEC_SLO)
    # judged at the interactive SLO, as without classes, that window would be infeasible
    flat = Window(**{**ok.__dict__, "classes": (), "ttft": 40.0})
    assert not slo_met(flat, SPEC_SLO)
    # a breach of the batch class (non-sheddable) is a breach ...
    late_batch = window(**{**KEPT, "batch": (150.0, 1.0, 8, 3)})
    assert not slo_met(late_batch, SPEC_SLO) and not feasible(late_batch, SPEC_SLO)
    # ... and of the sheddable one is not (it is served with what is left)
    late_spare = window(**{**KEPT, "spare": (600.0, 9.0, 2, 0)})
    assert slo_met(late_spare, SPEC_SLO) and feasible(late_spare, SPEC_SLO)
    # the interactive ITL within the decision margin only (0.9 x 0.5 s), as without classes
    close = window(**{**KEPT, "interactive": (1.0, 0.47, 20, 20)})
    assert slo_met(close, SPEC_SLO) and not feasible(close, SPEC_SLO)


def test_a_class_without_traffic_is_not_judged_and_the_layout_stays_the_same():
    quiet = window(interactive=KEPT["interactive"])  # no batch, no spare in this minute
    assert len(constraints(quiet, SPEC_SLO)) == len(constraints(window(**KEPT), SPEC_SLO)) == 6
    assert latency_constraints(quiet, SPEC_SLO)[2:] == [0.0, 0.0]
    assert feasible(quiet, SPEC_SLO)


def test_goodput_weighs_the_classes_by_priority():
    all_kept = window(**KEPT)
    assert objective_value(all_kept, "goodput") == pytest.approx(1.0)
    # the same number of requests missed, in the top class or the sheddable one: the top class's cost more
    top_missed = window(**{**KEPT, "interactive": (1.0, 0.3, 20, 18)})
    spare_missed = window(**{**KEPT, "spare": (30.0, 2.0, 2, 0)})
    weighted = 3 * 20 + 2 * 8 + 1 * 2
    assert objective_value(top_missed, "goodput") == pytest.approx((weighted - 3 * 2) / weighted)
    assert objective_value(spare_missed, "goodput") == pytest.approx((weighted - 1 * 2) / weighted)
    # a window that falls behind scores less, as without classes
    behind = replace(all_kept, request_rate=2 * all_kept.request_rate)
    assert objective_value(behind, "goodput") == pytest.approx(0.5)


def test_a_window_with_classes_survives_the_study_storage():
    w = window(**KEPT)
    stored = json.loads(json.dumps(w.to_dict()))  # trial user attributes are JSON
    assert window_of(stored) == w
    assert window_of({k: v for k, v in stored.items() if k != "classes"}).classes == ()  # older trials


def test_status_and_slomet_report_each_class_the_breached_first():
    state = TunerState(mode="auto", current=Knobs(256, 64))
    state.current_window = window(**{**KEPT, "batch": (150.0, 1.0, 8, 3), "spare": (600.0, None, 2, 0)})
    slo_status = dump(status_slo(state.current_window, SPEC_SLO))
    assert [c["name"] for c in slo_status["classes"]] == ["interactive", "batch", "spare"]
    by = {c["name"]: c for c in slo_status["classes"]}
    assert by["interactive"] == {"name": "interactive", "ttftSeconds": 1.0, "itlSeconds": 0.3, "attainment": 1.0,
                                 "met": True}
    assert by["batch"]["met"] is False and by["batch"]["attainment"] == pytest.approx(3 / 8)
    assert by["spare"]["met"] is False  # reported; never a breach of SLOMet
    slomet = next(c for c in conditions(state, SPEC_SLO) if c.type == ConditionType.SLO_MET)
    assert slomet.status == "False" and slomet.reason == "SLOBreached"
    assert slomet.message.startswith("batch: TTFT 150.000s (SLO 120s)"), slomet.message
    assert "spare, sheddable: TTFT 600.000s (SLO 60s), 0% kept" in slomet.message
    # and one SLOMet.<class> each, a sheddable class's included (reported, not judged)
    by_type = {c.type: c for c in conditions(state, SPEC_SLO)}
    assert [(by_type[f"SLOMet.{n}"].status, by_type[f"SLOMet.{n}"].reason) for n in CLASSES.names] == [
        ("True", "WithinSLO"), ("False", "SLOBreached"), ("False", "SLOBreached")]
    assert by_type["SLOMet.batch"].message == "batch: TTFT 150.000s (SLO 120s), ITL 1.000s (SLO 5s), 38% kept"
    state.current_window = window(**{**KEPT, "spare": (600.0, None, 2, 0)})
    slomet = next(c for c in conditions(state, SPEC_SLO) if c.type == ConditionType.SLO_MET)
    assert slomet.status == "True" and slomet.message.startswith("interactive: TTFT 1.000s (SLO 3s)")
    state.current_window = window(interactive=KEPT["interactive"])
    quiet = {c.type: c for c in conditions(state, SPEC_SLO)}["SLOMet.batch"]
    assert (quiet.status, quiet.reason, quiet.message) == ("Unknown", "NoTraffic", "batch: no traffic")


def test_a_resource_with_classes_is_tuned_for_them_in_its_own_study():
    from chunkpilot.tuner.daemon import ClusterConfig, tuning_config

    from ..operator.operator_proc import sample

    spec = sample("x")["spec"]
    cluster = ClusterConfig(prometheus_url="http://127.0.0.1:1", storage=":memory:")
    plain = tuning_config("ns", "x", spec, cluster)
    assert plain.classes is None and plain.settings.guidance == "model"
    spec["sloClasses"] = [{"name": "chat", "priority": 10, "ttft": {"thresholdSeconds": 2}},
                          {"name": "batch", "default": True}]
    classed = tuning_config("ns", "x", spec, cluster)
    assert classed.classes.names == ["chat", "batch"] and classed.classes.default == "batch"
    # the step-time model predicts a first-come-first-served step, not the classes' steps: Optuna searches
    assert classed.settings.guidance == "blackbox"
    assert classed.deployment != plain.deployment  # other constraints, another study
    spec["sloClasses"][0]["ttft"]["thresholdSeconds"] = 3
    assert tuning_config("ns", "x", spec, cluster).deployment != classed.deployment


def test_on_the_simulator_the_tuner_keeps_every_class_at_its_own_slo():
    """Interactive chat and batch summaries on one simulated engine with classes: the tuner ends on knobs whose
    windows keep both classes, where the batch TTFTs alone would have made every window infeasible at the
    interactive SLO."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from slo_classes import classes, trace

    from chunkpilot.sim import costmodel
    from chunkpilot.sim.simulator import SimActuator, SimMeasurer, Simulator
    from chunkpilot.tuner.loop import TunerLoop, TunerSettings
    from chunkpilot.tuner.space import SearchSpace
    from chunkpilot.tuner.study import TunerStudy

    cls = classes(3.0, 0.5)
    sim = Simulator(costmodel.default(), trace(0.6, 900, 5), Knobs(512, 512), max_num_seqs=32, max_model_len=4096,
                    classes=cls, class_of={"interactive": "interactive", "batch": "batch"})
    slo = cls.get("interactive").slo
    space = SearchSpace.from_bounds((64, 1024), (32, 1024), 16)
    study = TunerStudy(":memory:", "sim", space, slo, "goodput", seed=0)

    class Last:
        state = None

        def publish(self, state):
            self.state = state

    last = Last()
    loop = TunerLoop(TunerSettings(window=60, warmup=5, max_trials=6, min_requests=5, guidance="blackbox"), space,
                     study, SimActuator(sim), SimMeasurer(sim, slo), last, slo)
    sim.advance(65)
    for _ in range(8):
        loop.iterate()
    assert last.state.phase == "Exploiting"
    best = study.best()
    assert best is not None and best.feasible, best
    w = window_of(best.window)
    assert {c.name for c in w.classes} == {"interactive", "batch"}
    assert all(c.finished > 0 and c.met == c.finished for c in w.classes), w.classes
    # the same window judged as one population at the interactive SLO: the batch TTFTs breach it
    batch = next(c for c in w.classes if c.name == "batch")
    assert batch.ttft > slo.ttft.threshold
    assert not slo_met(replace(w, classes=tuple(replace(c, ttft_slo=3.0, itl_slo=0.5) for c in w.classes)), slo)
