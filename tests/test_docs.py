"""The docs cannot drift from what they describe: the results page is what bench/results/ says (regenerated and
compared, as the CRD and its reference are), every benchmark the page shows is one bench/run_all.sh runs, every
relative link in the docs points at a file that exists, and the README stays a page a newcomer reads in minutes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])


def results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("results_page", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_results_page_is_what_the_result_files_say():
    page = results_page()
    assert (ROOT / "docs" / "results.md").read_text() == page.page(), \
        "docs/results.md is stale: run python bench/results_page.py"


def test_the_readmes_headline_is_what_the_demo_runs_say():
    page = results_page()
    text = (ROOT / "README.md").read_text()
    assert text == page.readme(text), "README.md's headline is stale: run python bench/results_page.py"


def test_every_result_the_page_shows_is_one_run_all_runs():
    page = results_page()
    run_all = (ROOT / "bench" / "run_all.sh").read_text()
    for section in page.SECTIONS:
        assert (ROOT / "bench" / "results" / f"{section.name}.json").exists(), section.name
        script = Path(section.command.split()[1]).stem
        assert re.search(rf"\b{script}\b", run_all), f"{script} (for {section.name}) is not in bench/run_all.sh"
        out = re.search(r"--out (\S+)", section.command)
        if out:
            assert f"--out {out.group(1)}" in run_all, section.command
    assert "bench/results_page.py" in run_all


def test_a_changed_result_changes_the_page(tmp_path):
    """The check can fail: a figure edited in a copy of the results reads differently on the page."""
    import json
    import shutil

    page = results_page()
    copy = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", copy)
    doc = json.loads((copy / "chunk_overhead.json").read_text())
    doc["ratio_chunked_over_one_shot"] = 9.99
    (copy / "chunk_overhead.json").write_text(json.dumps(doc))
    assert "9.99×" in page.page(copy) and page.page(copy) != page.page()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(doc):
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S))  # code is not a link
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move reference material to docs/"


def _manifests_in_docs():
    import yaml

    for doc in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), flags=re.S):
            for obj in yaml.safe_load_all(block):
                if isinstance(obj, dict) and obj.get("kind") == "InferenceDeployment":
                    yield doc.name, obj


def test_the_inference_deployments_the_docs_show_pass_the_crd_and_the_operator():
    import jsonschema

    from chunkpilot.api import InferenceDeployment
    from chunkpilot.api.crd import crd_manifest

    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    shown = list(_manifests_in_docs())
    assert any(name == "README.md" for name, _ in shown)
    for name, obj in shown:
        jsonschema.Draft4Validator(schema).validate(obj)
        InferenceDeployment.model_validate(obj)
