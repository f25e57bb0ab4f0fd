"""deploy/prometheus checked by Prometheus' own promtool: configs, rules, and the rules' unit tests.

promtool comes with Prometheus (Debian package ``prometheus``, installed by
.ci/run). Without it these tests fail: they are the CI check of the rules.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support import REPO

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install Prometheus (apt-get install prometheus; .ci/run does)"
    return subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=120, cwd=PROMETHEUS_DIR)


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-kubernetes.yml"])
def test_scrape_configs_and_the_rules_they_load_are_valid(config):
    done = promtool("check", "config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 rule files found" in done.stdout + done.stderr


def test_rule_files_are_valid():
    rules = sorted(str(p.relative_to(PROMETHEUS_DIR)) for p in (PROMETHEUS_DIR / "rules").glob("*.yml"))
    assert rules == ["rules/alerts.yml", "rules/recording.yml"]
    done = promtool("check", "rules", *rules)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_unit_tests_pass():
    tests = sorted(str(p.relative_to(PROMETHEUS_DIR)) for p in (PROMETHEUS_DIR / "tests").glob("*.yml"))
    assert tests, "no rule unit tests in deploy/prometheus/tests"
    done = promtool("test", "rules", *tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout + done.stderr


def test_every_alert_has_a_unit_test_and_a_section_in_operations_md():
    import yaml

    alerts = [r["alert"] for g in yaml.safe_load((PROMETHEUS_DIR / "rules" / "alerts.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r]
    tested = {t["alertname"] for f in (PROMETHEUS_DIR / "tests").glob("*.yml")
              for case in yaml.safe_load(f.read_text())["tests"] for t in case.get("alert_rule_test", [])
              if t.get("exp_alerts")}
    ops = (PROMETHEUS_DIR.parent.parent / "docs" / "operations.md").read_text()
    assert set(alerts) <= tested, f"alerts never seen firing in a unit test: {set(alerts) - tested}"
    assert [a for a in alerts if f"### {a}" not in ops] == [], "alerts without a section in docs/operations.md"
