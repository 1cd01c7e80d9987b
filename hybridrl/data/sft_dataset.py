"""SFT examples in the RL layout, so the TrainEngine computes response log-probs directly.

An example is ``prompt`` tokens + ``response`` tokens + a loss mask over the response:

- single-turn (verl's ``SFTDataset``): the prompt column (a string, used as one user message, or a
  list of chat messages), followed through ``prompt_dict_keys`` when it holds a dict, is rendered
  with the chat template and the generation prompt, exactly as ``RLHFDataset`` renders prompts for
  rollout. The response column (through ``response_dict_keys``, e.g. ``extra_info -> solution``)
  is tokenized as plain text and the EOS token is appended (verl's convention), so SFT targets
  are exactly what a rollout generates before it stops. Every response token carries loss.
- multi-turn (verl's ``MultiTurnSFTDataset``): the conversation is rendered prefix by prefix with
  the chat template and each message's tokens are the text it adds. The prompt is everything
  before the first assistant message (with its generation prompt); the response is the rest, up
  to the last assistant message. The loss mask is 1 on assistant content up to and including its
  last EOS token (the end-of-turn token, e.g. ``<|im_end|>``), 0 on role headers, on the
  template's trailing newline and on user/system/tool messages.

``collate_sft`` pads a batch to its own longest prompt P (LEFT) and response R (RIGHT):
``input_ids / attention_mask / position_ids (B, T=P+R)``, ``prompts (B, P)``, ``responses (B, R)``,
``response_mask (B, R)`` (1 where the token carries loss). ``attention_mask`` is 1 on every real
token, user turns inside the response included.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.data.dataset import TRUNCATION_MODES
from hybridrl.data.files import DataFileError, check_messages, open_files
from hybridrl.protocol import DataProto, to_object_array


@dataclass
class SFTExample:
    """Token ids of one example; ``loss_mask`` has one entry per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    index: int = 0


class SFTDataset:
    """SFT rows from parquet / JSONL files; ``__getitems__`` tokenizes a batch on demand.

    Args:
        files: a path or a list of paths.
        tokenizer: a transformers tokenizer with a ``chat_template`` and an EOS token.
        prompt_key, response_key, prompt_dict_keys, response_dict_keys: single-turn columns
            (verl's ``data.*`` keys of the same names).
        multiturn, messages_key: multi-turn mode and its column.
        max_length: most prompt + response tokens; longer examples follow ``truncation``
            (``error`` | ``left``: drop the first tokens | ``right``: drop the last tokens).
        apply_chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        response_key: str = "response",
        prompt_dict_keys: Sequence[str] | None = None,
        response_dict_keys: Sequence[str] | None = None,
        multiturn: bool = False,
        messages_key: str = "messages",
        max_length: int = 1024,
        truncation: str = "error",
        apply_chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_length < 2:
            raise ValueError(f"data.max_length must be >= 2 (one prompt and one response token), got {max_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; SFT prompts are rendered as chat messages")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; SFT responses end with EOS")
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.prompt_key, self.response_key, self.messages_key = prompt_key, response_key, messages_key
        self.prompt_dict_keys = tuple(prompt_dict_keys or ())
        self.response_dict_keys = tuple(response_dict_keys or ())
        self.multiturn = multiturn
        self.chat_kwargs = dict(apply_chat_template_kwargs or {})
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.files = open_files(files)
        for f in self.files:
            for column in (messages_key,) if multiturn else (prompt_key, response_key):
                f.check_column(column)
        self._offsets = [0]
        for f in self.files:
            self._offsets.append(self._offsets[-1] + len(f))

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, item: int) -> SFTExample:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: Sequence[int]) -> list[SFTExample]:
        out = []
        for item in items:
            k = bisect.bisect_right(self._offsets, item) - 1
            row = item - self._offsets[k]
            record, where = self.files[k].row(row), f"{self.files[k].path} row {row}"
            prompt, response, mask = self._multiturn(record, where) if self.multiturn else self._single_turn(record, where)
            prompt, response, mask = self._truncate(prompt, response, mask, where)
            out.append(SFTExample(prompt, response, mask, index=item))
        return out

    def collate(self, items: list[SFTExample]) -> DataProto:
        return collate_sft(items, self.pad_token_id)

    # --------------------------------------------------------------------------------- rendering
    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **self.chat_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _single_turn(self, record: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
        prompt = follow_keys(record[self.prompt_key], self.prompt_dict_keys, f"{where} column {self.prompt_key!r}")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = check_messages(prompt, f"{where} column {self.prompt_key!r}")
        response = follow_keys(record[self.response_key], self.response_dict_keys, f"{where} column {self.response_key!r}")
        if not isinstance(response, str):
            raise DataFileError(f"{where} column {self.response_key!r}{_path(self.response_dict_keys)}: the response must be "
                                f"a string, got {type(response).__name__}; set data.response_dict_keys to reach it")
        response_ids = [*self.encode(response), self.tokenizer.eos_token_id]
        return self.encode(self.render(messages, True)), response_ids, [1] * len(response_ids)

    def _multiturn(self, record: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
        where = f"{where} column {self.messages_key!r}"
        messages = check_messages(record[self.messages_key], where)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant or assistant[0] == 0:
            raise DataFileError(f"{where}: a conversation needs an assistant message after at least one other message "
                                f"(roles: {[m['role'] for m in messages]})")
        pieces = [(self.render(messages[: assistant[0]], True), 0)]  # the prompt, as rollout renders it
        for i in range(assistant[0], assistant[-1] + 1):
            if messages[i]["role"] == "assistant":
                if i > assistant[0]:
                    pieces.append((self.render(messages[:i], True), 0))  # the assistant header
                pieces.append((self.render(messages[: i + 1], False), 1))
            else:
                pieces.append((self.render(messages[: i + 1], False), 0))
        segments = _text_diffs([text for text, _ in pieces], where)
        prompt_ids, response_ids, mask = self.encode(segments[0]), [], []
        for segment, (_, is_assistant) in zip(segments[1:], pieces[1:]):
            ids = self.encode(segment)
            response_ids += ids
            mask += _assistant_mask(ids, self.tokenizer.eos_token_id) if is_assistant else [0] * len(ids)
        keep = max(i for i, m in enumerate(mask) if m) + 1  # the template's text after the last answer is never trained
        return prompt_ids, response_ids[:keep], mask[:keep]

    def _truncate(self, prompt: list[int], response: list[int], mask: list[int], where: str):
        excess = len(prompt) + len(response) - self.max_length
        if excess <= 0:
            return prompt, response, mask
        if self.truncation == "error":
            raise DataFileError(f"{where}: the example is {len(prompt) + len(response)} tokens ({len(prompt)} prompt + "
                                f"{len(response)} response), longer than data.max_length={self.max_length}; raise it or set "
                                "data.truncation to left or right")
        if self.truncation == "left":
            prompt = prompt[excess:]
        else:
            response, mask = response[: len(response) - excess], mask[: len(mask) - excess]
        if not prompt or not any(mask):
            raise DataFileError(f"{where}: after data.truncation={self.truncation} to data.max_length={self.max_length} "
                                f"the example keeps {len(prompt)} prompt tokens and {sum(mask)} loss tokens; both must be "
                                "> 0: raise data.max_length")
        return prompt, response, mask


def follow_keys(value: Any, keys: Sequence[str], where: str) -> Any:
    """``value[k1][k2]...``: verl's ``prompt_dict_keys`` / ``response_dict_keys`` into a dict column."""
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DataFileError(f"{where}{_path(keys[:depth])}: no key {key!r} (found {have})")
        value = value[key]
    return value


def _path(keys: Sequence[str]) -> str:
    return "".join(f"[{k!r}]" for k in keys)


def _text_diffs(texts: list[str], where: str) -> list[str]:
    """``texts[0]`` then what each text adds to the one before; each must extend the previous one."""
    out, previous = [texts[0]], texts[0]
    for i, text in enumerate(texts[1:], start=1):
        if not text.startswith(previous):
            raise DataFileError(f"{where}: the chat template does not render the conversation prefix by prefix "
                                f"(rendering {i} does not extend rendering {i - 1}), so assistant tokens cannot be "
                                "located; templates that rewrite earlier turns are not supported")
        out.append(text[len(previous):])
        previous = text
    return out


def _assistant_mask(ids: list[int], eos_token_id: int) -> list[int]:
    """1 up to and including the last EOS of an assistant message; the template's text after it
    (a newline in ChatML) is formatting that rollout never generates, so it carries no loss."""
    last = max((i for i, t in enumerate(ids) if t == eos_token_id), default=len(ids) - 1)
    return [1] * (last + 1) + [0] * (len(ids) - last - 1)


def collate_sft(items: list[SFTExample], pad_token_id: int) -> DataProto:
    """Examples -> the RL layout (see the module doc); P and R are the batch's longest prompt and response."""
    if not items:
        raise ValueError("collate_sft got an empty list of examples")
    b, p, r = len(items), max(len(x.prompt_ids) for x in items), max(len(x.response_ids) for x in items)
    prompts = torch.full((b, p), pad_token_id, dtype=torch.long)
    responses = torch.full((b, r), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    response_attn = torch.zeros(b, r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i, x in enumerate(items):
        n, m = len(x.prompt_ids), len(x.response_ids)
        prompts[i, p - n:] = torch.as_tensor(x.prompt_ids)
        prompt_mask[i, p - n:] = 1
        responses[i, :m] = torch.as_tensor(x.response_ids, dtype=torch.long)
        response_attn[i, :m] = 1
        response_mask[i, :m] = torch.as_tensor(x.loss_mask, dtype=torch.long)
    attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"index": to_object_array([x.index for x in items])})


def sft_dataset_from_config(files: Sequence[str], tokenizer: Any, data: Any) -> SFTDataset:
    """An ``SFTDataset`` from the ``data`` section of an ``SFTConfig``."""
    return SFTDataset(
        list(files), tokenizer, prompt_key=data.prompt_key, response_key=data.response_key,
        prompt_dict_keys=data.prompt_dict_keys, response_dict_keys=data.response_dict_keys,
        multiturn=data.multiturn.enable, messages_key=data.multiturn.messages_key, max_length=data.max_length,
        truncation=data.truncation, apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs),
    )


__all__ = ["SFTDataset", "SFTExample", "collate_sft", "follow_keys", "sft_dataset_from_config"]
