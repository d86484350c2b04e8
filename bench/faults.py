"""Faults: the fault suite's schedule for longer, and what bad requests cost everyone else.

    python bench/faults.py                          # both parts, ~12 minutes
    python bench/faults.py --part suite --seeds 1 2 3 --duration 300
    python bench/faults.py --part requests --repeats 3

Part "suite" runs tests/faults/run.py (two `python -m app` servers sharing a journal on
a real redis-server, resilient clients, one seeded fault at a time: Redis paused, killed
and restarted, foreign and corrupt entries, a server killed -9 and restarted, a server
stalled past the claim time, client sockets dropped and resumed at random seqs) for each
seed, and reports the faults by kind and every invariant's violations (the CI test runs
one seed for 80 s).

Part "requests" starts `python -m app` with the default model, keeps one /ws reply
streaming, asks /health every 10 ms, and sends each bad request of issue 30 in turn: the
slowest /health answer while it was handled, against the slowest in the same run without
one (the baseline), the request's own answer, and the live stream's longest pause, in
engine steps (its median inter-token gap alone is one step).

Writes bench/results/faults.json and the tables into bench/README.md ("Faults").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from servers import start, stop, write_readme_block  # noqa: E402

from tests.faults.run import Plan, run  # noqa: E402

HI = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
    return value


def schema(value) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
    return {"messages": HI, "max_tokens": 8, "response_format": fmt}


# -- part "requests" ------------------------------------------------------------------------


def post_json(url: str, body: bytes) -> int | str:
    try:
        r = httpx.post(url + "/v1/chat/completions", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return r.status_code


def raw_post(url: str, head: list[str], parts, wait_s: float = 20.0) -> int | str:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{port}",
                 "Content-Type: application/json", *head, "", ""]  # fmt: skip
        s.sendall("\r\n".join(lines).encode())
        try:
            for part in parts:
                s.sendall(part)
        except OSError:
            pass
        try:
            reply = s.recv(4096)
        except TimeoutError:
            return f"no answer in {wait_s:g} s"
    return int(reply.split()[1]) if reply else "closed"


def ws_frame(url: str, frame: str) -> int | str:
    """400 for a bad_request that leaves the socket usable; else what happened."""

    async def main() -> int | str:
        async with websockets.connect(url.replace("http", "ws") + "/ws", max_size=None) as ws:
            await ws.send(frame)
            reply = json.loads(await asyncio.wait_for(ws.recv(), 120))
            await ws.send('{"type": "ping"}')  # and the socket is still there
            await asyncio.wait_for(ws.recv(), 120)
            return 400 if reply.get("code") == "bad_request" else reply.get("code", "?")

    try:
        return asyncio.run(main())
    except websockets.ConnectionClosed:
        return "socket closed"


def bad_requests(repeats: int) -> dict[str, callable]:
    """Each bad request, its payload built beforehand: the client's own work must not show
    in what is measured."""
    big = "1" * 5000
    chunk = 256 << 10
    piece = f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n"
    many = json.dumps({"messages": [{"role": "user", "content": ""}] * 100_000}).encode()
    enum = json.dumps(schema({"enum": [f"value-{i}" for i in range(20_000)]})).encode()
    deep = json.dumps(schema(nested(400))).encode()
    fresh = iter(
        [
            json.dumps(schema({"enum": [f"{r}-{i}" for i in range(3000)]})).encode()
            for r in range(repeats)
        ]
    )  # a new schema each time: no cache
    digits = f'{{"messages": {json.dumps(HI)}, "seed": {big}}}'.encode()
    ws_digits = (
        '{"type": "chat", "id": "x", "conversation_id": "big", "messages": '
        f'{json.dumps(HI)}, "params": {{"seed": {big}}}}}'
    )
    return {
        "/v1 schema: 20,000-value enum (290 KB)": lambda u: post_json(u, enum),
        "/v1 schema: nested 400 deep": lambda u: post_json(u, deep),
        "/v1 schema: 3,000-value enum (within the caps, new each time)":
            lambda u: post_json(u, next(fresh)),
        "/v1 100,000 empty messages": lambda u: post_json(u, many),
        "/v1 400 MB declared (Content-Length)": lambda u: raw_post(
            u, ["Content-Length: 400000000"], [b"{" + b" " * chunk]),
        "/v1 chunked body past 4 MiB": lambda u: raw_post(
            u, ["Transfer-Encoding: chunked"], [piece] * 24),  # 6 MiB, never ended
        "/v1 integer of 5,000 digits": lambda u: post_json(u, digits),
        "/v1 lone surrogate": lambda u: post_json(
            u, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        "/ws integer of 5,000 digits": lambda u: ws_frame(u, ws_digits),
        "/ws lone surrogate in a cancel id": lambda u: ws_frame(
            u, '{"type": "cancel", "id": "\\ud800"}'),
    }  # fmt: skip


def _ask_health(url: str, stop, out) -> None:
    rows = []
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            began = time.monotonic()
            client.get(url + "/health")
            rows.append((began, time.monotonic() - began))
            time.sleep(0.01)
    out.put(("health", rows))


def _follow_stream(url: str, stop, out) -> None:
    times: list[float] = []

    async def turns() -> None:
        n = 0
        async with websockets.connect(url.replace("http", "ws") + "/ws") as ws:
            while not stop.is_set():
                n += 1
                await ws.send(json.dumps({"type": "chat", "id": f"s{n}", "conversation_id":
                                          f"live-{n}", "messages": [{"role": "user", "content":
                                          "Tell me a long story."}], "params": {"max_tokens":
                                          400, "ignore_eos": True, "temperature": 0}}))  # fmt: skip
                while (f := json.loads(await ws.recv()))["type"] not in ("done", "error"):
                    if f["type"] == "token":
                        times.append(time.monotonic())
                    if stop.is_set():
                        return
                times.append(float("nan"))  # a new turn: no gap across it

    with contextlib.suppress(websockets.ConnectionClosed):
        asyncio.run(turns())
    out.put(("tokens", times))


class Watch:
    """/health every 10 ms, and a live /ws stream's token times, each in a process of its
    own (so that neither the other nor the requests sent here hold it up); times are
    time.monotonic(), one clock for every process of the machine."""

    def __init__(self, url: str) -> None:
        self.stop = multiprocessing.Event()
        self.out: multiprocessing.Queue = multiprocessing.Queue()
        self.procs = [multiprocessing.Process(target=f, args=(url, self.stop, self.out))
                      for f in (_ask_health, _follow_stream)]  # fmt: skip
        for proc in self.procs:
            proc.start()
        self.health: list[tuple[float, float]] = []
        self.tokens: list[float] = []

    def finish(self) -> None:
        self.stop.set()
        for _ in self.procs:
            kind, rows = self.out.get(timeout=120)
            setattr(self, kind, rows)
        for proc in self.procs:
            proc.join(30)

    def window(self, began: float, ended: float) -> tuple[float, float]:
        """The slowest /health answer asked in [began, ended], and the longest gap between
        two token frames of one turn that ends in it."""
        health = max((s for t, s in self.health if began <= t <= ended), default=0.0)
        gaps = [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)
                if began <= b <= ended and a == a and b == b]  # fmt: skip
        return health, max(gaps, default=0.0)

    def step(self) -> float:
        gaps = [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)
                if a == a and b == b]  # fmt: skip
        return statistics.median(gaps)


def start_app(root: Path) -> tuple[subprocess.Popen, str]:
    """`python -m app` from the checkout at `root` (this one, or an older one to compare)."""
    return start(["--kv-cache-size", "256MiB"], root=root)


def part_requests(repeats: int, root: Path = ROOT) -> dict:
    proc, url = start_app(root)
    try:
        requests = bad_requests(repeats)
        watch = Watch(url)
        time.sleep(5)  # the stream is under way
        quiet = (time.monotonic(), time.monotonic() + 5)
        time.sleep(5)
        windows = {}
        for name, send in requests.items():
            for i in range(repeats):
                began = time.monotonic()
                status = send(url)
                answered = time.monotonic()
                time.sleep(0.3)  # what it held up shows in the next answers too
                windows[name, i] = (status, answered - began, began, time.monotonic())
            print(name, windows[name, repeats - 1][:2], flush=True)
        watch.finish()
        results = {}
        for name in requests:
            rows = [windows[name, i] for i in range(repeats)]
            seen = [watch.window(b, e) for _, _, b, e in rows]
            results[name] = {
                "status": rows[-1][0],
                "answer_s": max(r[1] for r in rows),
                "health_max_s": max(h for h, _ in seen),
                "stream_gap_s": max(g for _, g in seen),
            }
        base_health, base_gap = watch.window(*quiet)
        return {"baseline_health_max_s": base_health, "baseline_gap_s": base_gap,
                "step_s": watch.step(), "requests": results}  # fmt: skip
    finally:
        stop(proc)


def requests_table(r: dict) -> str:
    step = r["step_s"]
    lines = [
        f"One /ws reply streaming throughout (its median inter-token gap, one engine step: "
        f"{step * 1000:.0f} ms); /health asked every 10 ms. Without a bad request: slowest "
        f"/health {r['baseline_health_max_s'] * 1000:.0f} ms, longest stream gap "
        f"{r['baseline_gap_s'] / step:.1f} steps.",
        "",
        "| bad request | answer | its time | slowest /health meanwhile | longest stream gap |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, x in r["requests"].items():
        lines.append(f"| {name} | {x['status']} | {x['answer_s'] * 1000:.0f} ms | "
                     f"{x['health_max_s'] * 1000:.0f} ms | "
                     f"{x['stream_gap_s'] / step:.1f} steps |")  # fmt: skip
    return "\n".join(lines)


# -- part "suite" ---------------------------------------------------------------------------


def part_suite(seeds: list[int], duration: float) -> list[dict]:
    out = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="parley-faults-") as folder:
            began = time.monotonic()
            report = asyncio.run(run(Plan(seed=seed, duration_s=duration), Path(folder)))
            row = {"seed": seed, "seconds": time.monotonic() - began, **report.__dict__,
                   "total_faults": report.total_faults}  # fmt: skip
        print(json.dumps(row, indent=1, default=str), flush=True)
        out.append(row)
    return out


def suite_table(rows: list[dict], duration: float) -> str:
    kinds = sorted({k for r in rows for k in r["faults"]})
    head = "| seed | " + " | ".join(kinds) + " | all faults | turns | violations |"
    lines = [f"Each seed: {duration:g} s of clients and faults (`--duration`), then the checks.",
             "", head, "|" + " --- |" * (len(kinds) + 5)]  # fmt: skip
    for r in rows:
        counts = " | ".join(str(r["faults"].get(k, 0)) for k in kinds)
        lines.append(f"| {r['seed']} | {counts} | {r['total_faults']} | {r['accepted']} | "
                     f"{len(r['violations'])} |")  # fmt: skip
    starts = [s for r in rows for s in r["starts"]]
    events: dict[str, int] = {}
    for r in rows:
        for k, v in r["journal"].items():
            events[k] = events.get(k, 0) + v
    lines += ["", f"Server starts: {len(starts)}, slowest {max(starts):.1f} s. What the "
              "servers' logs say they did: " + ", ".join(f"{k} {v}" for k, v in events.items())
              + "."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("suite", "requests", "both"), default="both")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also the requests against the server of this checkout (e.g. a "
        "`git worktree` of the commit before issue 30), for comparison",
    )
    args = ap.parse_args()
    results: dict = {}
    if args.part in ("requests", "both"):
        results["requests"] = part_requests(args.repeats)
        text = requests_table(results["requests"])
        if args.before is not None:
            results["before"] = part_requests(args.repeats, args.before.resolve())
            text += "\n\nThe same against the server before issue 30 (`--before`):\n\n"
            text += requests_table(results["before"])
        write_readme_block("faults-requests", "Faults", text)
    if args.part in ("suite", "both"):
        results["suite"] = part_suite(args.seeds, args.duration)
        write_readme_block("faults-suite", "Faults", suite_table(results["suite"], args.duration))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "faults.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
