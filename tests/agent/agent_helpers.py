"""Test doubles for the agent-loop tests: a scripted engine and tools that fail on purpose."""

from __future__ import annotations

import threading

import torch

from hybridrl.data.dataset import left_pad
from hybridrl.protocol import DataProto, to_object_array
from hybridrl.tools import BaseTool


def charwise(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` encoded one character at a time: a valid but NON-canonical tokenization, so a
    loop that decoded and re-encoded turns would store different ids."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def script_logprob(token_id: int, position: int) -> float:
    return -((token_id * 7 + position) % 97 + 1) / 100.0


class ScriptedEngine:
    """Stands in for NativeRolloutEngine.generate_tensors: row r's next turn is
    ``scripts[key][t]`` where ``key`` is the script key found in the row's text and ``t`` the number
    of assistant headers after the prompt's. Records every call (unpadded inputs and outputs)."""

    def __init__(self, tokenizer, scripts: dict[str, list[list[int]]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []

    def generate_tensors(self, input_ids, attention_mask, position_ids, params):
        rows, width = input_ids.shape[0], params.max_new_tokens
        out = {"responses": torch.zeros(rows, width, dtype=torch.long),
               "response_mask": torch.zeros(rows, width, dtype=torch.long),
               "rollout_log_probs": torch.zeros(rows, width)}
        inputs, outputs = [], []
        for row in range(rows):
            ids = input_ids[row][attention_mask[row].bool()].tolist()
            text = self.tokenizer.decode(ids)
            key = next(k for k in self.scripts if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            tokens = self.scripts[key][min(turn, len(self.scripts[key]) - 1)][:width]
            out["responses"][row, : len(tokens)] = torch.tensor(tokens)
            out["response_mask"][row, : len(tokens)] = 1
            out["rollout_log_probs"][row, : len(tokens)] = torch.tensor(
                [script_logprob(t, p) for p, t in enumerate(tokens)])
            inputs.append(ids)
            outputs.append(tokens)
        self.calls.append((inputs, outputs))
        return out


def make_prompts(tokenizer, questions: list[str], width: int = 48, extra_infos=None) -> DataProto:
    """Left-padded chat prompts (N, width) with ``raw_prompt`` and ``extra_info`` columns."""
    rows, raws = [], []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append(left_pad(tokenizer.encode(ids, add_special_tokens=False), width, tokenizer.pad_token_id))
        raws.append(messages)
    tensors = {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(("input_ids", "attention_mask", "position_ids"))}
    infos = extra_infos or [{"index": i} for i in range(len(questions))]
    return DataProto.from_dict(tensors=tensors, non_tensors={"raw_prompt": to_object_array(raws),
                                                             "extra_info": to_object_array(infos)})


class RaisingTool(BaseTool):
    default_schema = {"type": "function", "function": {"name": "boom", "parameters": {"type": "object"}}}

    def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("kaboom")


class HangingTool(BaseTool):
    """Blocks until ``release_all`` (a hung tool); the loop must time it out and move on."""

    default_schema = {"type": "function", "function": {"name": "sleepy", "parameters": {"type": "object"}}}
    gate = threading.Event()

    def execute(self, instance_id, parameters, **kwargs):
        self.gate.wait(60)
        return "too late"


class AnswerTool(BaseTool):
    """Per-sample state from create_kwargs; calc_reward = 1 when the submitted answer matched."""

    default_schema = {"type": "function", "function": {
        "name": "submit", "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                                         "required": ["answer"]}}}

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.state, self.released = {}, []

    def create(self, instance_id, ground_truth=None, **kwargs):
        self.state[instance_id] = {"truth": ground_truth, "reward": 0.0, "seen_kwargs": None}

    def execute(self, instance_id, parameters, **kwargs):
        state = self.state[instance_id]
        state["seen_kwargs"] = kwargs
        state["reward"] = float(parameters["answer"] == state["truth"])
        return "submitted"

    def calc_reward(self, instance_id, **kwargs):
        return self.state[instance_id]["reward"]

    def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
