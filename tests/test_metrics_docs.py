"""docs/metrics.md lists every metric a server exports (here one engine; the disaggregated and data-parallel servers
are checked in test_pd and test_data_parallel), and the Grafana dashboard in examples/ queries only those."""

from __future__ import annotations

import json
import pathlib
import re

import httpx

from server_helpers import InProcessServer, documented_metrics, undocumented_metrics

ROOT = pathlib.Path(__file__).parent.parent


def test_every_exported_metric_is_documented(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "100", "--spec-method", "ngram",
                           "--prefix-cache-dir", str(tmp_path / "kv")], str(tmp_path / "metrics.log"))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b a b a b", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
    finally:
        assert srv.stop() == 0
    assert undocumented_metrics(text) == set()
    assert "justapi_time_to_first_token_seconds_bucket" in text  # (the check above saw real samples)
    assert "justapi_prefix_cache_disk_rejected_total" in text  # the disk tier's too


def test_the_grafana_dashboard_queries_documented_metrics_only():
    dash = json.loads((ROOT / "examples" / "grafana" / "justapi.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs
             for n in re.findall(r"\b((?:justapi|prefix_cache)_[a-z0-9_]+)\b", e)}
    assert names and names <= documented_metrics(), names - documented_metrics()
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])  # picked at import
