"""Datasets (parquet / JSONL in verl's row format), the resumable prompt loader, preprocessing and
the built-in synthetic tasks.

Names are imported lazily so that ``python -m hybridrl.data.preprocess`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RLHFDataset": "hybridrl.data.dataset",
    "collate_prompts": "hybridrl.data.dataset",
    "left_pad": "hybridrl.data.dataset",
    "DataFileError": "hybridrl.data.files",
    "RowFile": "hybridrl.data.files",
    "PromptDataLoader": "hybridrl.data.loader",
    "ResumableBatchSampler": "hybridrl.data.loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridrl.data' has no attribute {name!r}")
