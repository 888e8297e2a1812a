"""The DVC plots: dvc.yaml's plot definitions with the templates in .dvc/plots draw exactly the TTT steps the curve
rows hold and both methods' acceptance per draft position; the offline page template (tools/plots_page.py) is one
that DVC accepts, and it replaces DVC's CDN script tags with the inlined libraries."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eaglepipe.evaluate import run as evaluate

ROOT = Path(__file__).resolve().parents[2]


def plots_page():
    spec = importlib.util.spec_from_file_location("plots_page", ROOT / "tools/plots_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def curve_rows(steps: int, epochs: int = 2) -> list[dict]:
    """Rows in train.run's history format, with values that tell every (epoch, split, step) apart."""
    return [
        {"epoch": e, "split": s, "step": k, "loss": 5.0 - e - k / 10, "acc": e / 10 + k / 100}
        for e in range(1, epochs + 1)
        for s in ("train", "valid")
        for k in range(steps)
    ]


def dvc(project: Path, *args) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
    )  # as the project's .dvc/config: no reports
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture
def project(tmp_path):
    """dvc.yaml and the plot templates in a bare DVC project (no git)."""
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    dvc(tmp_path, "init", "--no-scm", "-q")
    shutil.copytree(ROOT / ".dvc/plots", tmp_path / ".dvc/plots")
    (tmp_path / "metrics").mkdir()
    return tmp_path


@pytest.mark.e2e
@pytest.mark.parametrize("steps", [2, 5])
def test_plots_draw_the_steps_and_positions_the_rows_hold(project, steps):
    rows = curve_rows(steps)
    (project / "metrics/train_curves.json").write_text(json.dumps(rows))
    positions = evaluate.position_rows({"eagle": [0.3, 0.1, 0.05], "ngram": [0.4, 0.2, 0.1]})
    (project / "metrics/eval_positions.json").write_text(json.dumps(positions))
    shown = json.loads(dvc(project, "plots", "show", "--json"))
    assert not shown.get("errors"), shown["errors"]
    specs = {name: plots[0]["content"] for name, plots in shown["data"].items()}
    assert set(specs) == {"Drafter accuracy per TTT step", "Drafter loss per TTT step", "metrics/eval_positions.json"}
    for name, metric in (("Drafter accuracy per TTT step", "acc"), ("Drafter loss per TTT step", "loss")):
        spec = specs[name]
        assert spec["encoding"]["x"]["field"] == "epoch" and spec["encoding"]["y"]["field"] == metric
        assert spec["encoding"]["color"]["field"] == "step" and spec["encoding"]["strokeDash"]["field"] == "split"
        drawn = {(v["epoch"], v["split"], v["step"]): v[metric] for v in spec["data"]["values"]}
        assert drawn == {(r["epoch"], r["split"], r["step"]): r[metric] for r in rows}
    spec = specs["metrics/eval_positions.json"]
    assert spec["encoding"]["x"]["field"] == "position" and spec["encoding"]["color"]["field"] == "method"
    drawn = {(v["method"], v["position"]): v["acceptance_rate"] for v in spec["data"]["values"]}
    assert drawn == {
        ("eagle", 1): 0.3,
        ("eagle", 2): 0.1,
        ("eagle", 3): 0.05,
        ("ngram", 1): 0.4,
        ("ngram", 2): 0.2,
        ("ngram", 3): 0.1,
    }


def test_position_rows_number_positions_from_one():
    assert evaluate.position_rows({"eagle": [0.5, 0.25], "ngram": [0.125]}) == [
        {"position": 1, "method": "eagle", "acceptance_rate": 0.5},
        {"position": 2, "method": "eagle", "acceptance_rate": 0.25},
        {"position": 1, "method": "ngram", "acceptance_rate": 0.125},
    ]


@pytest.mark.e2e
def test_page_template_is_accepted_by_dvc_and_replaces_the_cdn(project, tmp_path):
    page = plots_page().page({"lib-a": "var a = '</script>';", "lib-b": "var b = 1;"})
    assert "</script>'" not in page and "<\\/script>'" in page  # an inlined library cannot end its element early
    assert page.index("lib-a") < page.index("lib-b")
    template = tmp_path / "page.html"
    template.write_text(page)
    (project / "metrics/train_curves.json").write_text(json.dumps(curve_rows(3)))
    (project / "metrics/eval_positions.json").write_text(json.dumps(evaluate.position_rows({"eagle": [0.3]})))
    dvc(project, "plots", "show", "--html-template", str(template), "-o", "out")
    html = (project / "out/index.html").read_text()
    assert "var b = 1;" in html and "vegaEmbed(" in html and "cdn.jsdelivr" not in html
    assert "{plot_divs}" not in html and "{refresh_tag}" not in html


def test_page_refuses_a_library_that_holds_a_dvc_placeholder():
    with pytest.raises(ValueError, match="plot_divs"):
        plots_page().page({"lib": "x = '{plot_divs}'"})
