"""RLHFDataset: verl-format prompt files -> left-padded, chat-templated prompt tensors.

Each row has a ``prompt`` column (``prompt_key``) holding chat messages; the tokenizer's chat
template is applied with ``add_generation_prompt=True`` and the text is tokenized without extra
special tokens (the template already has them). Prompts are LEFT-padded to ``max_prompt_length``
(P) with ``position_ids = clamp(cumsum(attention_mask) - 1, min=0)``. A prompt longer than P is
truncated by ``truncation`` (``left``: keep the last P tokens, ``right``: keep the first P,
``error``: raise) unless ``filter_overlong_prompts`` drops it when the dataset is built.

An item is a dict: ``input_ids``, ``attention_mask``, ``position_ids`` (P,) tensors, ``raw_prompt``
(the messages, if ``return_raw_chat``), ``full_prompts`` (the templated text, if
``return_full_prompt``), ``index`` (``extra_info["index"]`` when present, else the
row's position in the concatenated files) and every other column of the row (``data_source``,
``reward_model``, ``extra_info``, ``ability``, ...). :func:`collate_prompts` turns a list of items
into a DataProto.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridrl.data.files import DataFileError, RowFile, check_messages, open_files
from hybridrl.protocol import DataProto, to_object_array

logger = logging.getLogger(__name__)
TRUNCATION_MODES = ("error", "left", "right")
TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")


class RLHFDataset(torch.utils.data.Dataset):
    """Prompt dataset over one or more parquet / JSONL files in verl's row format.

    Args:
        files: a path or a list of paths (``data.train_files``).
        tokenizer: a transformers tokenizer with a ``chat_template``.
        max_prompt_length: P.
        prompt_key: the column holding the chat messages.
        truncation: ``error`` | ``left`` | ``right``.
        filter_overlong_prompts: drop rows longer than P at build time (tokenizes every prompt once).
        return_raw_chat: add the messages as ``raw_prompt``.
        return_full_prompt: add the templated prompt text as ``full_prompts``.
        required_columns: columns every row must have besides ``prompt_key`` (``data_source`` str,
            ``reward_model`` dict are what the reward manager reads).
        apply_chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int = 1024,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        return_raw_chat: bool = False,
        return_full_prompt: bool = False,
        required_columns: Sequence[str] = ("data_source", "reward_model"),
        apply_chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; prompts are chat messages and need one")
        self.tokenizer, self.max_prompt_length, self.prompt_key = tokenizer, max_prompt_length, prompt_key
        self.truncation, self.return_raw_chat = truncation, return_raw_chat
        self.return_full_prompt = return_full_prompt
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.pad_token_id = _pad_token_id(tokenizer)
        self.files = open_files(files)
        self._offsets = [0]
        for f in self.files:
            _check_required(f, prompt_key, required_columns)
            self._offsets.append(self._offsets[-1] + len(f))
        self._keep = list(range(self._offsets[-1]))
        if filter_overlong_prompts:
            self._keep = self._filter_overlong()

    def __len__(self) -> int:
        return len(self._keep)

    def _locate(self, global_row: int) -> tuple[int, int]:
        """(file number, row in that file) of a row of the concatenated files."""
        k = bisect.bisect_right(self._offsets, global_row) - 1
        return k, global_row - self._offsets[k]

    def _records(self, items: Sequence[int]) -> list[tuple[int, int, dict[str, Any]]]:
        """(file number, row, row dict) for dataset items, reading each file once."""
        located = [self._locate(self._keep[i]) for i in items]
        by_file: dict[int, list[int]] = {}
        for pos, (k, _) in enumerate(located):
            by_file.setdefault(k, []).append(pos)
        records: list[Any] = [None] * len(items)
        for k, positions in by_file.items():
            for pos, record in zip(positions, self.files[k].rows([located[p][1] for p in positions])):
                records[pos] = (k, located[pos][1], record)
        return records

    def _messages(self, file: RowFile, row: int, value: Any) -> list[dict[str, str]]:
        return check_messages(value, f"{file.path} row {row} column {self.prompt_key!r}")

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat-templated prompt text (with the generation prompt)."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
        )

    def _filter_overlong(self) -> list[int]:
        """Global rows whose templated prompt fits in P tokens (batched tokenization, one pass)."""
        keep: list[int] = []
        for k, f in enumerate(self.files):
            prompts = f.column(self.prompt_key)
            texts = [self.render(self._messages(f, i, p)) for i, p in enumerate(prompts)]
            lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            keep += [self._offsets[k] + i for i, n in enumerate(lengths) if n <= self.max_prompt_length]
        dropped = self._offsets[-1] - len(keep)
        logger.info("filter_overlong_prompts: kept %d rows, dropped %d longer than %d tokens",
                    len(keep), dropped, self.max_prompt_length)
        if not keep:
            names = [str(f.path) for f in self.files]
            raise DataFileError(f"{names}: every prompt is longer than max_prompt_length={self.max_prompt_length}")
        return keep

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: Sequence[int]) -> list[dict[str, Any]]:
        """Items for several indices with one Arrow read and one batched tokenizer call (torch's
        DataLoader and :class:`PromptDataLoader` use this)."""
        records = self._records(items)
        messages = [self._messages(self.files[k], row, rec.pop(self.prompt_key)) for k, row, rec in records]
        texts = [self.render(m) for m in messages]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for (k, row, record), msgs, text, ids in zip(records, messages, texts, encoded):
            ids = self._truncate(ids, f"{self.files[k].path} row {row}")
            item: dict[str, Any] = dict(zip(TENSOR_KEYS, left_pad(ids, self.max_prompt_length, self.pad_token_id)))
            item.update(record)
            if self.return_raw_chat:
                item["raw_prompt"] = msgs
            if self.return_full_prompt:
                item["full_prompts"] = text
            extra_info = record.get("extra_info")
            has_index = isinstance(extra_info, dict) and extra_info.get("index") is not None
            item["index"] = extra_info["index"] if has_index else self._offsets[k] + row
            out.append(item)
        return out

    def _truncate(self, ids: list[int], where: str) -> list[int]:
        if len(ids) <= self.max_prompt_length:
            return ids
        if self.truncation == "left":
            return ids[-self.max_prompt_length :]
        if self.truncation == "right":
            return ids[: self.max_prompt_length]
        raise DataFileError(
            f"{where}: the prompt is {len(ids)} tokens, longer than max_prompt_length={self.max_prompt_length}; "
            "set truncation to 'left' or 'right', or filter_overlong_prompts=True"
        )

    def collate(self, items: list[dict[str, Any]]) -> DataProto:
        """Same as :func:`collate_prompts` (a method so a loader can hold just the dataset)."""
        return collate_prompts(items)


def _pad_token_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise ValueError("the tokenizer has neither a pad_token_id nor an eos_token_id to pad prompts with")


def _check_required(f: RowFile, prompt_key: str, required: Sequence[str]) -> None:
    """Every row has the prompt (valid chat messages) and the required columns with the right types."""
    f.check_messages_column(prompt_key)
    for name in required:
        f.check_column(name, {"data_source": str, "reward_model": dict, "extra_info": dict}.get(name))


def left_pad(ids: list[int], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids (<= length) -> (input_ids, attention_mask, position_ids), each (length,), LEFT-padded."""
    start = length - len(ids)
    input_ids = torch.full((length,), pad_token_id, dtype=torch.long)
    input_ids[start:] = torch.as_tensor(ids, dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    attention_mask[start:] = 1
    # equals clamp(cumsum(attention_mask) - 1, min=0) for a left-padded row
    position_ids = torch.zeros(length, dtype=torch.long)
    position_ids[start:] = torch.arange(len(ids))
    return input_ids, attention_mask, position_ids


def collate_prompts(items: list[dict[str, Any]], add_uid: bool = False) -> DataProto:
    """Items of :class:`RLHFDataset` -> DataProto with tensors ``input_ids, attention_mask,
    position_ids`` (N, P) and one non-tensor column per other key (None where an item lacks it).
    ``add_uid`` adds a fresh ``uid`` (uuid4 string) per prompt; the trainer may do this instead."""
    if not items:
        raise ValueError("collate_prompts got an empty list of items")
    tensors = {k: torch.stack([it[k] for it in items]) for k in TENSOR_KEYS}
    keys = sorted({k for it in items for k in it} - set(TENSOR_KEYS))
    non_tensors = {k: to_object_array([it.get(k) for it in items]) for k in keys}
    if add_uid:
        non_tensors["uid"] = to_object_array([str(uuid.uuid4()) for _ in items])
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
