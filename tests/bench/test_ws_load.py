"""bench/ws_load.py against a live server (tiny model): every turn accounted for, and the
token counts agree with the server's /metrics."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.engine.async_engine import AsyncEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.tiny import tiny_engine

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ws_load.py"


def generation_tokens(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("parley:generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no generation counter")


@pytest.fixture
def server(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer, num_blocks=2048, max_num_seqs=16))
    with live_server(create_app(engine=engine)) as s:
        s.engine = engine
        yield s


def load(server, tmp_path, *extra):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(SCRIPT), "--url", server.url.replace("http", "ws") + "/ws",
           "--out", str(out), "--max-tokens", "8", "--timeout", "120", *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180)
    return json.loads(out.read_text())


def test_every_turn_is_accounted_for_and_matches_the_metrics(server, tmp_path):
    before = generation_tokens(server.url)
    result = load(server, tmp_path, "--users", "3", "--turns", "4", "--compare-no-reuse")
    after = generation_tokens(server.url)
    reuse, plain = result["runs"]["reuse"], result["runs"]["no_reuse"]
    for run in (reuse, plain):
        assert run["turns"] == run["turns_started"] == 12 and run["errors"] == {}
        assert {r["index"] for r in run["records"]} == {1, 2, 3, 4}
        for r in run["records"]:
            assert r["completion_tokens"] == 8 and r["finish_reason"] == "length"
            assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and len(r["itl_s"]) <= 7
        assert run["output_tokens"] == sum(r["completion_tokens"] for r in run["records"])
    assert after - before == reuse["output_tokens"] + plain["output_tokens"]
    later = [r for r in reuse["records"] if r["index"] > 1]
    assert all(r["cached_tokens"] > 0 for r in later)
    assert plain["cached_tokens"] == 0  # cache: false computes every prompt token
    assert set(result["comparison"]) >= {"total_time_ratio", "last_turn_ttft_speedup"}


def test_gaps_are_per_token_when_frames_carry_several(server, tmp_path):
    """A server that sends 4 tokens a frame (--stream-interval 4): the inter-token gaps
    split each frame's gap over its tokens; the frames' own gaps are kept beside them."""
    server.engine.stream_interval = 4
    result = load(server, tmp_path, "--users", "2", "--turns", "2")
    records = result["runs"]["reuse"]["records"]
    for r in records:
        assert r["completion_tokens"] == 8 and len(r["frame_gap_s"]) <= 2
        assert sum(r["itl_s"]) == pytest.approx(sum(r["frame_gap_s"]))
    assert any(len(r["itl_s"]) > len(r["frame_gap_s"]) for r in records)


def test_duration_and_open_loop_stop_by_themselves(server, tmp_path):
    result = load(server, tmp_path, "--rate", "4", "--duration", "2", "--turns", "2")
    run = result["runs"]["reuse"]
    assert run["turns"] == run["turns_started"] > 0 and run["errors"] == {}
    assert run["wall_s"] < 60
