"""Engine replicas on Ray against one process, on the same cores, under bench/ws_load.py;
and the front's ceiling with simulated replicas.

    python bench/cluster_load.py                   # 16 users x 6 turns, 2 replicas vs 1
    python bench/cluster_load.py --users 8 --turns 4 --kill-after 20
    python bench/cluster_load.py --only replicas --kill-after 0    # the front's CPU alone
    python bench/cluster_load.py --simulate 8 --users 64 --turns 4  # the front's ceiling
    python bench/cluster_load.py --only replicas --kill-after 0 --stream-interval 4

Runs the same ws_load workload (greedy, 64-token replies, the whole history every turn)
against `python -m app --replicas 2 --threads 1` and against `python -m app --threads 2`,
alternating, and reports prompt-token reuse and throughput as ratios, inter-token latency,
and the front's CPU per relayed token (the server process's user + system CPU time over
the run / the output tokens it relayed; Ray's replicas are processes of their own). Then,
with --kill-after S, once more against the replicas while one replica process is killed S
seconds in: every turn must complete or end with a retryable error, none may hang.

--simulate N runs the load against N simulated replicas instead (`--simulate-replicas`:
no model, one token per running request per step, --steps-per-s steps a second) through
the real front and Ray: what one front relays at most, and its CPU per token there.
--root runs the server from another checkout (the same bench against an older front).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servers import ROOT, start, stop


def replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::Replica"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of one process (not its children: Ray's actors are apart)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU time of each of a process's threads, summed by thread name."""
    by_name: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        by_name[name] = by_name.get(name, 0.0) + seconds
    return by_name


def idle_cpu(pid: int, seconds: float = 5.0) -> float:
    """CPU seconds a second the process uses with nothing to serve (Ray's threads, the
    heartbeats, timers): what it costs whatever the load."""
    before = sum(cpu_seconds(pid))
    time.sleep(seconds)
    return (sum(cpu_seconds(pid)) - before) / seconds


def load(url: str, args, out: Path, kill_after: float | None = None, front: int = 0) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "ws_load.py"), "--url",
           url.replace("http", "ws") + "/ws", "--users", str(args.users), "--turns",
           str(args.turns), "--think", "0", "--out", str(out), "--timeout", "1800"]  # fmt: skip
    before = cpu_seconds(front) if front else (0.0, 0.0)
    threads_before = thread_seconds(front) if front else {}
    client = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if kill_after is not None:
        time.sleep(kill_after)
        pids = replica_pids()
        print(f"killing replica process {pids[0]} of {pids}", file=sys.stderr)
        os.kill(pids[0], signal.SIGKILL)
    client.wait()
    result = json.loads(out.read_text())["runs"]["reuse"]
    after = cpu_seconds(front) if front else None
    result["front_cpu_s"] = sum(after) - sum(before) if after else None
    result["front_system_s"] = after[1] - before[1] if after else None
    if front:
        after = thread_seconds(front)
        result["front_threads_s"] = {
            name: t - threads_before.get(name, 0.0) for name, t in after.items()
        }
    return result


def describe(kind: str, s: dict) -> None:
    itl = s["itl_s"]
    print(f"{kind:9s} turns {s['turns']}/{s['turns_started']} in {s['wall_s']:.1f} s, "
          f"{s['output_tok_s']:.1f} tok/s, reused {s['cached_tokens']}/{s['prompt_tokens']} "
          f"prompt tokens, inter-token p50 {itl['p50'] * 1e3:.1f} ms p90 "
          f"{itl['p90'] * 1e3:.1f} ms, errors {s['errors'] or 'none'}")  # fmt: skip
    frames = s["frame_gap_s"]
    if frames != itl:  # several tokens a frame (--stream-interval)
        print(f"          between frames p50 {frames['p50'] * 1e3:.1f} ms "
              f"p90 {frames['p90'] * 1e3:.1f} ms")  # fmt: skip
    if s["front_cpu_s"] is not None:
        tokens = s["output_tokens"]
        print(f"          the front process: {s['front_cpu_s']:.1f} s of CPU for {tokens} "
              f"output tokens, {s['front_cpu_s'] / tokens * 1e6:.0f} us a token "
              f"({s['front_system_s'] / tokens * 1e6:.0f} us of it in the kernel)")  # fmt: skip
        idle = s.get("front_idle_cpu")
        if idle is not None:
            print(f"          idle, the front uses {idle * 1e3:.1f} ms of CPU a second: "
                  f"{idle * s['wall_s'] / tokens * 1e6:.0f} us a token of this run")  # fmt: skip
        busiest = sorted(s["front_threads_s"].items(), key=lambda kv: -kv[1])[:4]
        print("          by thread: " + ", ".join(
            f"{name} {t / tokens * 1e6:.0f} us" for name, t in busiest if t > 0))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kill-after", type=float, default=30.0, help="0: no kill run")
    ap.add_argument("--only", choices=["replicas", "single"], help="run one kind only")
    ap.add_argument("--simulate", type=int, default=0, metavar="N",
                    help="N simulated replicas (no model) instead of real ones")  # fmt: skip
    ap.add_argument("--steps-per-s", type=float, default=50.0, help="of a simulated replica")
    ap.add_argument("--root", type=Path, default=ROOT, help="run the server from this checkout")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the server's --stream-interval (tokens a frame)")  # fmt: skip
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    kinds = {"replicas": ["--replicas", "2", "--threads", "1"], "single": ["--threads", "2"]}
    if args.stream_interval != 1:
        kinds = {k: [*v, "--stream-interval", str(args.stream_interval)] for k, v in kinds.items()}
    if args.simulate:
        kinds = {"simulated": ["--replicas", str(args.simulate), "--threads", "1",
                               "--simulate-replicas", str(args.steps_per_s)]}  # fmt: skip
        args.kill_after = 0
    elif args.only:
        kinds = {args.only: kinds[args.only]}
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind, flags in kinds.items() if r % 2 == 0 else reversed(kinds.items()):
            proc, url = start(flags, root=args.root)
            try:
                idle = idle_cpu(proc.pid)
                runs[kind].append(load(url, args, tmp / f"{kind}-{r}.json", front=proc.pid))
                runs[kind][-1]["front_idle_cpu"] = idle
            finally:
                stop(proc)
    for kind, results in runs.items():
        describe(kind, results[-1])

    def mean(kind: str, key: str) -> float:
        return sum(s[key] for s in runs[kind]) / len(runs[kind])

    if set(runs) == {"replicas", "single"}:
        reuse = {k: mean(k, "cached_tokens") / mean(k, "prompt_tokens") for k in kinds}
        print(f"prompt tokens reused, replicas / single: "
              f"{reuse['replicas'] / reuse['single']:.2f}x (target >= 0.95x)")  # fmt: skip
        print(f"throughput, replicas / single: "
              f"{mean('replicas', 'output_tok_s') / mean('single', 'output_tok_s'):.2f}x "
              f"(target >= 0.9x)")  # fmt: skip
    if args.kill_after and "replicas" in kinds:
        proc, url = start(kinds["replicas"], root=args.root)
        try:
            s = load(url, args, tmp / "kill.json", args.kill_after)
        finally:
            stop(proc)
        hung = s["turns_started"] - s["turns"] - sum(s["errors"].values())
        print(f"a replica killed {args.kill_after:.0f} s in: {s['turns']} of "
              f"{s['turns_started']} turns completed, errors {s['errors'] or 'none'}, "
              f"hung {hung}")  # fmt: skip


if __name__ == "__main__":
    main()
