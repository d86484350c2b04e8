"""The compiled kernels' cache is keyed by what the build depends on: a second build
environment (another torch install, another compiler) gets a build of its own instead of
rebuilding the first's, and a compile says so while it runs."""

import os

import torch

from app.model import kernels
from tests.model.kernel_builds import load_in_process

SOURCE = b"// the same source"


def test_the_key_follows_the_torch_install_and_the_compiler(monkeypatch):
    base = kernels.build_key(SOURCE)
    assert kernels.build_key(SOURCE) == base  # stable
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert kernels.build_key(SOURCE) != base
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "no-such-compiler++")
    assert kernels.build_key(SOURCE) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)  # another torch build
    assert kernels.build_key(SOURCE) != base
    monkeypatch.undo()
    assert kernels.build_key(SOURCE, march="x86-64-v3") != base
    inputs = kernels.build_inputs()
    assert inputs["torch_dir"] == os.path.dirname(os.path.realpath(torch.__file__))
    assert inputs["compiler"].startswith("/")  # resolved to the binary that runs


def test_two_build_environments_keep_a_build_each(tmp_path, avx2_build):
    """The session's AVX2 build is the first environment's; a second compiler's build
    joins it in the same cache, and neither rebuilds the other."""
    cache, march, key, log = avx2_build
    assert "compiling Parley's CPU kernels" in log  # said while it compiles
    built = {p: p.stat().st_mtime for p in (cache / "kernels" / key).glob("*.so")}
    assert built
    again, log = load_in_process(cache, march)
    assert again == key and "compiling" not in log  # cached
    # Another compiler (a wrapper of its own, as another environment's would be).
    wrapper = tmp_path / "bin" / "c++"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    other, log = load_in_process(cache, march, {"CXX": str(wrapper)})
    assert other != key and "compiling" in log
    # The first environment's build is untouched: it loads without compiling.
    first, log = load_in_process(cache, march)
    assert first == key and "compiling" not in log
    assert {p: p.stat().st_mtime for p in (cache / "kernels" / key).glob("*.so")} == built
