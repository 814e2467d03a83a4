"""Where qa_1 / qa_2 find SQuAD v2.0 dev and HotpotQA dev-distractor v1.

Upstream: ``scripts/data/synthetic/json/download_qa_dataset.sh`` downloads them from the official
URLs (saved as ``squad.json`` / ``hotpotqa.json``). Here they keep their official file names and are
looked for, in order, in ``qa_data_dir``, ``$RESKV_RULER_QA_DIR`` and ``<assets>/ruler_qa`` (where a
download lands). A download is tried from the official URLs only, with a short timeout; when
nothing is found the task raises ``benchmarks.TaskUnavailable`` (never a silent score of 0). Both
datasets are CC BY-SA 4.0.
"""

from __future__ import annotations

import http.client
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

from benchmarks import TaskUnavailable
from reskv.assets import ASSETS_DIR

QA_DIR_ENV = "RESKV_RULER_QA_DIR"
DOWNLOAD_DIR = ASSETS_DIR / "ruler_qa"
DOWNLOAD_TIMEOUT_S = 10
QA_FILES = {
    "squad": ("dev-v2.0.json", "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json"),
}  # fmt: skip


def candidate_dirs(qa_data_dir: str | Path | None) -> list[Path]:
    dirs = [Path(qa_data_dir)] if qa_data_dir else []
    if os.environ.get(QA_DIR_ENV):
        dirs.append(Path(os.environ[QA_DIR_ENV]))
    return [*dirs, DOWNLOAD_DIR]


def download(url: str, target: Path) -> bool:
    """Fetch ``url`` into ``target`` atomically; False when unreachable."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as out:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                shutil.copyfileobj(response, out)
        os.replace(staging, target)
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        Path(staging).unlink(missing_ok=True)


def locate(dataset: str, qa_data_dir: str | Path | None = None) -> Path:
    """The dataset's json file, downloaded if reachable; ``TaskUnavailable`` otherwise."""
    name, url = QA_FILES[dataset]
    dirs = candidate_dirs(qa_data_dir)
    for folder in dirs:
        if (folder / name).is_file():
            return folder / name
    if download(url, DOWNLOAD_DIR / name):
        return DOWNLOAD_DIR / name
    searched = ", ".join(str(folder) for folder in dirs)
    raise TaskUnavailable(
        f"RULER qa needs {name} ({dataset}); it is not in {searched} and {url} is unreachable. "
        f"Download it where the internet is reachable and pass its folder on the command line as "
        f"benchmark.options.qa_data_dir=DIR or set the environment variable {QA_DIR_ENV}=DIR "
        f"(file name {name}, as published)."
    )
