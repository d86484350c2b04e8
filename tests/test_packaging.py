"""A regular install starts: the wheel carries static/ and templates/, and the server it
installs serves the page and its scripts when started from another folder."""

import os
import site
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_site_dirs() -> list[str]:
    """Where this interpreter finds its packages: its own site-packages (a virtualenv's when
    the suite runs in one), the base's when that environment borrows them, the user's."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


def borrow(python: Path) -> None:
    """Make the environment of `python` see this interpreter's packages after its own: a
    .pth file in its site-packages names them (its own copy of a package still wins)."""
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(own, "borrowed-from-the-suite.pth").write_text("\n".join(running_site_dirs()) + "\n")


def test_the_wheel_serves_the_page_from_anywhere(tmp_path, smollm):  # smollm: model cached
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(dist), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = dist.glob("parley-*.whl")
    # A fresh environment that borrows the dependencies (torch, ...) of the one running
    # the suite, whether that is the system's Python or a virtualenv.
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    borrow(python)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import app; print(app.__file__)"],
        cwd=elsewhere, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert str(env_dir) in where, f"the installed package was not the one imported: {where}"

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    server = subprocess.Popen(
        [str(python), "-m", "app", "--port", str(port), "--kv-cache-size", "64MiB",
         "--log-level", "warning"],
        cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"the server exited:\n{server.stdout.read()}"
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.5)
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "app.js" in page.text
        script = httpx.get(url + "/static/app.js")
        assert script.status_code == 200 and "import" in script.text
    finally:
        server.terminate()
        server.wait(30)
