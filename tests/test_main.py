"""python -m app: flags, environment variables, sizes."""

import pytest

from app.__main__ import build_parser, engine_config, main
from app.config import parse_size


def test_environment_sets_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("PARLEY_KV_CACHE_SIZE", "256MiB")
    monkeypatch.setenv("PARLEY_PORT", "9001")
    args = build_parser().parse_args([])
    assert args.kv_cache_size == 256 << 20 and args.port == 9001
    args = build_parser().parse_args(["--port", "9002", "--max-num-seqs", "4"])
    assert args.port == 9002
    config = engine_config(args)
    assert config.cache.kv_cache_bytes == 256 << 20 and config.scheduler.max_num_seqs == 4
    assert config.stream_interval == 1
    assert engine_config(build_parser().parse_args(["--stream-interval", "4"])).stream_interval == 4


@pytest.mark.parametrize("flags", [["--stream-interval", "0"], ["--max-num-seqs", "0"]])
def test_bad_engine_values_are_one_line_before_anything_loads(flags):
    with pytest.raises(SystemExit, match=r"^parley: .* must be at least 1"):
        main(flags)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "5XB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_quantization_flag_and_environment(monkeypatch):
    assert engine_config(build_parser().parse_args([])).model.quantization == "auto"
    monkeypatch.setenv("PARLEY_QUANTIZATION", "int8")
    assert engine_config(build_parser().parse_args([])).model.quantization == "int8"
    args = build_parser().parse_args(["--quantization", "none"])
    assert engine_config(args).model.quantization == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "int2"])


def test_dtype_flag(monkeypatch):
    assert engine_config(build_parser().parse_args([])).model.dtype == "auto"
    monkeypatch.setenv("PARLEY_DTYPE", "bfloat16")
    assert engine_config(build_parser().parse_args([])).model.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "float64"])


def test_resume_and_journal_flags(monkeypatch):
    from app.__main__ import server_config

    config = server_config(build_parser().parse_args([]))
    assert config.streams.grace_s == 60.0 and config.journal is None
    monkeypatch.setenv("PARLEY_JOURNAL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("PARLEY_JOURNAL_REQUIRED", "0")
    args = build_parser().parse_args(["--resume-grace", "5", "--port", "8123"])
    config = server_config(args)
    assert config.streams.grace_s == 5.0
    assert config.journal.url == "redis://127.0.0.1:6379/0" and not config.journal.required
    assert config.journal.consumer.endswith(":8123")
    args = build_parser().parse_args(["--journal-required", "--journal-consumer", "blue",
                                      "--journal-timeout", "0.5"])  # fmt: skip
    journal = server_config(args).journal
    assert journal.required and journal.consumer == "blue" and journal.timeout_s == 0.5


def test_kv_tier_flags(monkeypatch):
    tier = engine_config(build_parser().parse_args([])).tier
    assert (tier.kind, tier.size_bytes, tier.store) == ("memory", 2 << 30, "evict")
    args = build_parser().parse_args(
        ["--kv-tier", "redis://:pw@h:6380/1", "--kv-tier-ttl", "60", "--kv-tier-store", "evict"]
    )
    tier = engine_config(args).tier
    assert (tier.kind, tier.location, tier.ttl_s, tier.store) == (
        "redis",
        "redis://:pw@h:6380/1",
        60,
        "evict",
    )
    args = build_parser().parse_args(["--kv-tier", "redis://h:6380/1"])
    assert engine_config(args).tier.store == "finish"  # shared: others may want it now
    monkeypatch.setenv("PARLEY_KV_TIER", "none")
    assert engine_config(build_parser().parse_args([])).tier.kind == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-tier", "memcached://h"])


def test_device_and_cuda_graph_flags(monkeypatch):
    config = engine_config(build_parser().parse_args([]))
    assert (config.device, config.cuda_graphs) == ("auto", True)
    args = build_parser().parse_args(["--device", "cpu", "--no-cuda-graphs"])
    assert (engine_config(args).device, engine_config(args).cuda_graphs) == ("cpu", False)
    monkeypatch.setenv("PARLEY_DEVICE", "cuda:1")
    monkeypatch.setenv("PARLEY_CUDA_GRAPHS", "0")
    config = engine_config(build_parser().parse_args([]))
    assert (config.device, config.cuda_graphs) == ("cuda:1", False)


def test_a_kv_cache_larger_than_the_memory_is_refused_before_loading(monkeypatch):
    import app.engine.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "available_memory", lambda: 4 << 30)
    with pytest.raises(SystemExit, match=r"does not fit in the 4\.0 GiB"):
        main(["--kv-cache-size", "8GiB"])
    with pytest.raises(SystemExit, match=r"2 x 3\.0 GiB"):  # one pool per replica
        main(["--kv-cache-size", "3GiB", "--replicas", "2"])


# -- the first start ----------------------------------------------------------------------


def test_help_groups_every_flag_and_shows_its_default():
    from app.__main__ import FLAGS, GROUPS

    grouped = [flag for flags in GROUPS.values() for flag in flags]
    assert sorted(grouped) == sorted(flag for flag, _ in FLAGS), "put each flag in a group"
    parser = build_parser()
    text = parser.format_help()
    for title in GROUPS:
        assert f"\n{title}:\n" in text
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "(default: " in action.help, action.option_strings
    assert "python -m app" in text


def test_help_runs_as_a_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert "model:" in out.stdout and "(default: 8000)" in out.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_in_use_is_found_before_anything_loads():
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "app", "--port", str(port)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "--port " in out.stderr.splitlines()[-1]  # a way out
    assert "app.model" not in out.stderr and "Traceback" not in out.stderr  # nothing loaded


def test_the_address_is_printed_once_the_page_answers():
    import subprocess
    import sys

    import httpx

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--port", str(port), "--kv-cache-size", "64MiB",
         "--kv-tier", "none"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "Parley is ready" in line:
                break
        assert lines and "Parley is ready" in lines[-1], "".join(lines)
        assert f"open http://127.0.0.1:{port}/ in a browser" in lines[-1]
        # What it was doing came first, and the page answers the moment it says so.
        assert "loading SmolLM2-135M-Instruct" in lines[0]
        assert any("engine ready" in line for line in lines)
        assert any("event loop: uvloop" in line for line in lines)  # a dependency here
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_allowed_hosts_and_origins_flags(monkeypatch):
    from app.__main__ import server_config

    config = server_config(build_parser().parse_args([]))
    assert config.allowed_hosts == () and config.host_policy().host_ok("localhost:8000")
    assert not config.host_policy().host_ok("evil.example:8000")
    monkeypatch.setenv("PARLEY_ALLOWED_HOSTS", "chat.example.org, .corp.example")
    args = build_parser().parse_args(["--allowed-origins", "https://chat.example.org"])
    config = server_config(args)
    assert config.allowed_hosts == ("chat.example.org", ".corp.example")
    assert config.allowed_origins == ("https://chat.example.org",)
    assert "chat.example.org" in config.describe()[0]


def test_prefix_cache_isolation_is_on_with_several_tenants_and_said(tmp_path):
    from app.__main__ import server_config

    keys = tmp_path / "keys"
    keys.write_text("alice a-key\nbob b-key\n")
    config = server_config(build_parser().parse_args(["--api-keys-file", str(keys)]))
    assert config.chat_config().isolate_prefix_cache
    assert "prefix cache isolated per tenant (2 tenants)" in config.describe()
    args = ["--api-keys-file", str(keys), "--prefix-cache-isolation", "none"]
    config = server_config(build_parser().parse_args(args))
    assert not config.chat_config().isolate_prefix_cache
    assert any("SHARED by 2 tenants" in line for line in config.describe())
    config = server_config(build_parser().parse_args(["--api-key", "k"]))
    assert not config.chat_config().isolate_prefix_cache  # one tenant: nobody to hide from
    config = server_config(build_parser().parse_args(["--prefix-cache-isolation", "tenant"]))
    assert "prefix cache isolated per browser client" in config.describe()


def test_per_client_share_flags(monkeypatch):
    from app.__main__ import server_config

    chat = server_config(build_parser().parse_args([])).chat
    assert (chat.max_connections_per_client, chat.max_turns_per_client) == (64, 64)
    assert chat.idle_timeout_s == 300.0
    monkeypatch.setenv("PARLEY_IDLE_TIMEOUT", "30")
    args = ["--max-connections-per-client", "8", "--max-turns-per-client", "4"]
    chat = server_config(build_parser().parse_args(args)).chat
    assert (chat.max_connections_per_client, chat.max_turns_per_client) == (8, 4)
    assert chat.idle_timeout_s == 30.0


def test_metrics_key_flag(monkeypatch):
    from app.__main__ import server_config

    assert server_config(build_parser().parse_args([])).metrics_key is None
    config = server_config(build_parser().parse_args(["--api-key", "k"]))
    assert any("/metrics is open" in line for line in config.describe())
    monkeypatch.setenv("PARLEY_METRICS_KEY", "scrape")
    config = server_config(build_parser().parse_args(["--api-key", "k"]))
    assert config.metrics_key == "scrape"
    assert not any("/metrics" in line for line in config.describe())


def test_connections_to_the_servers_socket_send_without_nagle():
    """The socket python -m app takes: asyncio turns Nagle off on each connection it
    accepts (a kept-alive connection's every request after the first had waited 40 ms for
    the client's delayed ACK when it did not)."""
    import asyncio
    import socket

    from app.__main__ import take_port

    sock = take_port("127.0.0.1", 0)

    async def accept_one() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def connected(reader, writer) -> None:
            raw = writer.get_extra_info("socket")
            seen.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accept_one()) != 0


def test_the_idle_server_wakes_once_a_tick_and_a_signal_ends_it_at_once(monkeypatch):
    """uvicorn's own loop wakes ten times a second to look for a shutdown; Parley's waits
    a whole tick, so a signal must wake it: with a tick of an hour, SIGTERM still ends it
    (else this test hangs), after exactly one more tick of uvicorn's bookkeeping."""
    import asyncio
    import signal

    import uvicorn

    import app.__main__ as entry

    async def asgi(scope, receive, send):  # never called
        raise AssertionError

    monkeypatch.setattr(entry, "TICK_S", 3600.0)
    config = uvicorn.Config(asgi, log_level="error")
    config.load()
    server = entry.ReadyServer(config, "http://127.0.0.1:1/")
    ticks = []
    on_tick = server.on_tick

    async def counted(counter):
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted

    async def run():
        asyncio.get_running_loop().call_later(0.35, server.handle_exit, signal.SIGTERM, None)
        await asyncio.wait_for(server.main_loop(), 60)

    asyncio.run(run())
    assert server.should_exit and len(ticks) == 2
    assert any(name == b"date" for name, _ in server.server_state.default_headers)
