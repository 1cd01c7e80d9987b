"""The multi-turn agent loop: generate -> parse tool calls -> run tools / ask the interaction ->
append their turn -> generate again, for a whole batch of episodes at once.

Token in, token out. Each episode keeps the exact token ids the engine sampled and, between them,
the ids of tool and user turns tokenized ONCE (with the chat template's turn wrapper, see
:class:`TurnEncoder`). The next turn's prompt is those accumulated ids, never a re-rendered chat,
so what the trainer sees is what the model produced (no re-tokenization drift).

Batching: every turn, all live episodes decode together in one ``generate_tensors`` call
(left-padded), the tools of all episodes run concurrently in threads (each call bounded by its
tool's ``timeout_s``), then the next turn starts. Episodes end on: a turn without a tool call and
without an interaction, the interaction terminating, ``max_assistant_turns`` / ``max_user_turns``
(user turns count tool-response and interaction turns, as in verl), or the response budget R.

Output (B = N*n rows, sample g of prompt i at row i*n+g), the standard rollout layout:
``prompts (B,P)`` the initial prompt; ``responses (B,R)`` every turn after it (model, tool and user
tokens) right-padded; ``response_mask (B,R)`` 1 only on model-sampled tokens; ``rollout_log_probs
(B,R)`` 0 elsewhere; ``input_ids / attention_mask / position_ids (B,T)`` with attention 1 on every
real token (tool and user tokens included); non-tensor ``num_turns`` (assistant + user turns + 1,
verl's count), ``tool_call_counts`` and ``extra_info`` with ``num_turns`` and
``rollout_reward_scores`` (``{"user_turn_rewards": [...], <tool name>: reward}``) added for the
reward function. The losses and GAE already skip response_mask-0 positions.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridrl.interactions import Interaction, load_interaction_config, pick_interaction
from hybridrl.protocol import DataProto, to_object_array
from hybridrl.rollout.base import SamplingParams
from hybridrl.tools import CallJob, ToolRegistry, load_tool_config, parse_tool_calls
from hybridrl.tools.parser import PARSERS
from hybridrl.tools.registry import check_tools_kwargs

logger = logging.getLogger(__name__)
TRUNCATE_SIDES = ("left", "middle", "right")


@dataclass(frozen=True)
class AgentLoopConfig:
    """Flat settings (from ``actor_rollout_ref.rollout.multi_turn`` and ``response_length``)."""

    response_length: int
    """R: token budget of all turns after the prompt together."""
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_tool_response_length: int = 256
    """Tool responses longer than this many tokens are cut (before the turn wrapper is added)."""
    tool_response_truncate_side: str = "middle"
    """verl's meaning: left keeps the start, right keeps the end, middle keeps both ends."""
    max_parallel_calls: int = 1
    """Tool calls run per turn; later calls of the same turn are ignored."""
    format: str = "hermes"

    def __post_init__(self) -> None:
        if self.response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {self.response_length}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"multi_turn.tool_response_truncate_side={self.tool_response_truncate_side!r}; "
                             f"allowed: {list(TRUNCATE_SIDES)}")
        if self.format not in PARSERS:
            raise ValueError(f"multi_turn.format={self.format!r}; allowed: {sorted(PARSERS)}")
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"multi_turn.{key}={value} must be >= 1 or null")
        if self.max_parallel_calls < 1 or self.max_tool_response_length < 1:
            raise ValueError("multi_turn.max_parallel_calls and max_tool_response_length must be >= 1")


class TurnEncoder:
    """Token ids of tool / user turns, exactly as the chat template wraps them.

    The ids of appended ``messages`` are the template's rendering of ``base + messages`` (with the
    generation prompt, i.e. the next assistant header) minus the rendering of ``base``, a fixed
    conversation ending with an assistant turn. The model stops AT its end-of-turn token (EOS), so
    the template's text after that token in ``base`` (ChatML: a newline) starts the delta.
    """

    BASE = ({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = {"chat_template": chat_template} if chat_template else {}
        self.base_text = self.render(list(self.BASE), add_generation_prompt=False)
        eos = tokenizer.eos_token or ""
        cut = self.base_text.rfind(eos) if eos else -1
        self.after_eos = self.base_text[cut + len(eos):] if cut >= 0 else ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **self.template_kwargs)

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of ``messages`` appended after an assistant turn, ending with the next assistant header."""
        text = self.render([*self.BASE, *messages], add_generation_prompt=True)
        if not text.startswith(self.base_text):
            raise ValueError("the chat template renders earlier turns differently once messages are appended, so "
                             "turns cannot be tokenized one at a time; pass a prefix-stable template (chat_template=)")
        return list(self.tokenizer.encode(self.after_eos + text[len(self.base_text):], add_special_tokens=False))

    def check(self, mode: str) -> bool:
        """verl's ``tokenization_sanity_check_mode``: whether turn-by-turn ids equal whole-chat ids for
        a probe conversation; a mismatch is logged (``disable``: not checked)."""
        if mode == "disable":
            return True
        probe = [{"role": "tool", "content": "12"}]
        whole = self.tokenizer.encode(self.render([*self.BASE, *probe], True), add_special_tokens=False)
        eos = self.tokenizer.eos_token or ""
        head = self.base_text[: len(self.base_text) - len(self.after_eos)] if eos else self.base_text
        parts = self.tokenizer.encode(head, add_special_tokens=False) + self.encode(probe)
        same = whole == parts if mode == "strict" else _strip_eq(self.tokenizer, whole, parts)
        if not same:
            logger.warning("multi-turn: tool/user turns tokenize differently one at a time than inside the whole chat "
                           "(harmless for training, which uses the turn-by-turn ids, but SFT data rendered as a whole "
                           "chat will not match them exactly)")
        return same


def _strip_eq(tokenizer: Any, a: list[int], b: list[int]) -> bool:
    return tokenizer.decode(a).strip() == tokenizer.decode(b).strip()


@dataclass
class Episode:
    """One sample's growing conversation: ids, masks and log-probs of everything after the prompt."""

    prompt_ids: list[int]
    messages: list[dict[str, str]]
    instance_id: str
    tools_kwargs: dict[str, Any] | None = None
    interaction: Interaction | None = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    last_tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    done: bool = False
    end: str = ""

    def add(self, ids: list[int], from_model: bool, log_probs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [int(from_model)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def finish(self, reason: str) -> None:
        self.done, self.end = True, reason


class AgentLoop:
    """Runs multi-turn episodes on a rollout engine with ``generate_tensors`` (the native engine).

    engine: has ``generate_tensors(input_ids, attention_mask, position_ids, params)``.
    tokenizer: the policy's tokenizer (its chat template wraps tool / user turns).
    tools: the registry (None: no tool calls are parsed). interactions: ``{name: interaction}``.
    chat_template: a template to use instead of the tokenizer's for tool / user turns.
    """

    def __init__(self, engine: Any, tokenizer: Any, config: AgentLoopConfig, tools: ToolRegistry | None = None,
                 interactions: dict[str, Interaction] | None = None, chat_template: str | None = None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.tools = tools if tools is not None and len(tools) else None
        self.interactions = dict(interactions or {})
        self.encoder = TurnEncoder(tokenizer, chat_template)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Run ``params.n`` episodes per prompt row; see the module docstring for the output.

        prompts: ``input_ids, attention_mask (N,P)`` left-padded; optional non-tensor ``extra_info``
        (``tools_kwargs``, ``interaction_kwargs``) and ``raw_prompt`` (the chat messages, shown to
        interactions). ``params.max_new_tokens`` is ignored: the budget is ``config.response_length``.
        """
        episodes = self._start(prompts, params.n)
        try:
            turn = 0
            while live := [e for e in episodes if not e.done]:
                self._generate_turn(live, params, turn)
                self._respond(live)
                turn += 1
        finally:
            self._finish(episodes)
        return self._assemble(prompts, episodes, params.n)

    # ----------------------------------------------------------------------------------- stages
    def _start(self, prompts: DataProto, n: int) -> list[Episode]:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        extra = prompts.non_tensor_batch.get("extra_info")
        raw = prompts.non_tensor_batch.get("raw_prompt")
        episodes = []
        for b in range(len(prompts) * n):
            i = b // n
            info = extra[i] if extra is not None and isinstance(extra[i], dict) else {}
            try:
                episodes.append(self._start_episode(ids[i][mask[i]].tolist(), raw[i] if raw is not None else [], info))
            except ValueError as exc:
                self._finish(episodes)  # release what the earlier rows created
                raise ValueError(f"multi-turn rollout, prompt row {i} (extra_info index {info.get('index')}): {exc}") from exc
        return episodes

    def _start_episode(self, prompt_ids: list[int], messages: list, info: dict[str, Any]) -> Episode:
        kwargs = dict(info.get("interaction_kwargs") or {})
        episode = Episode(prompt_ids=prompt_ids, messages=list(messages), instance_id=str(uuid.uuid4()),
                          tools_kwargs=info.get("tools_kwargs"), interaction=pick_interaction(self.interactions, kwargs),
                          interaction_kwargs=kwargs)
        if self.tools is not None:
            self.tools.create(episode.instance_id, episode.tools_kwargs)
        if episode.interaction is not None:
            episode.interaction.start_interaction(episode.instance_id, **kwargs)
        return episode

    def _generate_turn(self, live: list[Episode], params: SamplingParams, turn: int) -> None:
        """One decoding call for all live episodes; each keeps at most its remaining budget."""
        budgets = [self.config.response_length - len(e.response_ids) for e in live]
        input_ids, attention_mask, position_ids = left_pad_batch([e.prompt_ids + e.response_ids for e in live],
                                                                 self.pad_token_id)
        seed = None if params.seed is None else turn_seed(params.seed, turn)
        out = self.engine.generate_tensors(input_ids, attention_mask, position_ids,
                                           params.with_updates(n=1, max_new_tokens=max(budgets), seed=seed))
        stop_ids = set(params.stop_ids)
        lengths = out["response_mask"].sum(-1).tolist()
        for row, (episode, budget) in enumerate(zip(live, budgets)):
            length = min(int(lengths[row]), budget)
            tokens = out["responses"][row, :length].tolist()
            episode.add(tokens, from_model=True, log_probs=out["rollout_log_probs"][row, :length].tolist())
            episode.last_tokens = tokens
            episode.stopped = bool(tokens) and tokens[-1] in stop_ids
            episode.assistant_turns += 1

    def _respond(self, live: list[Episode]) -> None:
        """Decide each episode's next step; run all tool calls together, then the interactions."""
        tool_turns: list[tuple[Episode, list[CallJob], list[str]]] = []
        user_turns: list[Episode] = []
        for episode in live:
            text = self.tokenizer.decode(episode.last_tokens, skip_special_tokens=True)
            episode.messages.append({"role": "assistant", "content": text})
            if not episode.stopped:
                episode.finish("length")
            elif self._at_turn_cap(episode):
                episode.finish("max_turns")
            elif self.tools is not None and (parsed := parse_tool_calls(text, self.config.format)).has_calls:
                kwargs = check_tools_kwargs(episode.tools_kwargs, self.tools.tools)
                calls = parsed.calls[: self.config.max_parallel_calls]
                jobs = [CallJob(c, episode.instance_id, kwargs.get(c.name, {}).get("execute_kwargs", {})) for c in calls]
                tool_turns.append((episode, jobs, parsed.errors))
            elif episode.interaction is not None:
                user_turns.append(episode)
            else:
                episode.finish("stop")
        results = iter(self.tools.execute([job for _, jobs, _ in tool_turns for job in jobs]) if tool_turns else [])
        for episode, jobs, errors in tool_turns:
            texts = [next(results).text for _ in jobs] + [f"Error: {error}" for error in errors]
            episode.tool_calls += len(jobs)
            self._append_turn(episode, [{"role": "tool", "content": self._truncate(t)} for t in texts])
        for episode in user_turns:
            self._ask_interaction(episode)

    def _at_turn_cap(self, episode: Episode) -> bool:
        """No further turn may follow: the assistant or user turn cap is reached."""
        cfg = self.config
        return (cfg.max_assistant_turns is not None and episode.assistant_turns >= cfg.max_assistant_turns) or (
            cfg.max_user_turns is not None and episode.user_turns >= cfg.max_user_turns)

    def _ask_interaction(self, episode: Episode) -> None:
        terminate, text, reward, _ = episode.interaction.generate_response(
            episode.instance_id, episode.messages, **episode.interaction_kwargs)
        episode.turn_scores.append(float(reward))
        if terminate:
            episode.finish("interaction")
        else:
            self._append_turn(episode, [{"role": "user", "content": str(text)}])

    def _append_turn(self, episode: Episode, messages: list[dict[str, str]]) -> None:
        """Append tool / user tokens (mask 0), or end the episode when no room would be left to answer."""
        ids = self.encoder.encode(messages)
        if len(episode.response_ids) + len(ids) >= self.config.response_length:
            episode.finish("length")
            return
        episode.messages.extend(messages)
        episode.add(ids, from_model=False)
        episode.user_turns += 1

    def _truncate(self, text: str) -> str:
        """Cut a tool response to ``max_tool_response_length`` tokens on verl's side convention."""
        limit = self.config.max_tool_response_length
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        side = self.config.tool_response_truncate_side
        if side == "left":
            return self.tokenizer.decode(ids[:limit]) + "...(truncated)"
        if side == "right":
            return "(truncated)..." + self.tokenizer.decode(ids[-limit:])
        half = limit // 2
        return self.tokenizer.decode(ids[:half]) + "...(truncated)..." + self.tokenizer.decode(ids[len(ids) - (limit - half):])

    def _finish(self, episodes: list[Episode]) -> None:
        """Tool rewards and releases, interaction finalization, for every episode (also on errors)."""
        for episode in episodes:
            if self.tools is not None:
                episode.tool_rewards = self.tools.finish(episode.instance_id, episode.tools_kwargs)
            if episode.interaction is not None:
                episode.interaction.finalize_interaction(episode.instance_id)

    def _assemble(self, prompts: DataProto, episodes: list[Episode], n: int) -> DataProto:
        tensors = assemble_tensors(prompts.batch["input_ids"], prompts.batch["attention_mask"], episodes,
                                   n, self.config.response_length, self.pad_token_id)
        non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        extra = non_tensors.get("extra_info")
        infos = []
        for b, episode in enumerate(episodes):
            info = dict(extra[b]) if extra is not None and isinstance(extra[b], dict) else {}
            info["num_turns"] = num_turns(episode)
            info["rollout_reward_scores"] = {"user_turn_rewards": list(episode.turn_scores), **episode.tool_rewards}
            infos.append(info)
        non_tensors["extra_info"] = to_object_array(infos)
        non_tensors["num_turns"] = to_object_array([num_turns(e) for e in episodes])
        non_tensors["tool_call_counts"] = to_object_array([e.tool_calls for e in episodes])
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(prompts.meta_info))


def num_turns(episode: Episode) -> int:
    """verl's count: assistant turns + user turns (tool responses and interaction turns) + 1."""
    return episode.assistant_turns + episode.user_turns + 1


def turn_seed(seed: int, turn: int) -> int:
    """A per-turn sampling seed derived from the rollout seed (63 bits)."""
    return int(np.random.SeedSequence([seed, turn]).generate_state(1, np.uint64)[0] >> 1)


def left_pad_batch(seqs: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists -> input_ids, attention_mask, position_ids (b, max len), LEFT-padded."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, width - len(seq):] = 1
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def assemble_tensors(input_ids: torch.Tensor, attention_mask: torch.Tensor, episodes: list[Episode], n: int,
                     length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Episodes -> the rollout columns; prompts (N,P) are repeated n times, R = ``length``."""
    rows = len(episodes)
    responses = torch.full((rows, length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, length), dtype=attention_mask.dtype)
    log_probs = torch.zeros((rows, length), dtype=torch.float32)
    real = torch.zeros((rows, length), dtype=attention_mask.dtype)
    for b, episode in enumerate(episodes):
        used = len(episode.response_ids)
        responses[b, :used] = torch.tensor(episode.response_ids, dtype=torch.long)
        response_mask[b, :used] = torch.tensor(episode.response_mask, dtype=attention_mask.dtype)
        log_probs[b, :used] = torch.tensor(episode.log_probs, dtype=torch.float32)
        real[b, :used] = 1
    prompts = input_ids.repeat_interleave(n, dim=0)
    full_mask = torch.cat([attention_mask.repeat_interleave(n, dim=0), real], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": full_mask,
        "position_ids": (full_mask.cumsum(-1) - 1).clamp(min=0).to(torch.long),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }


def build_agent_loop(engine: Any, tokenizer: Any, multi_turn: Any, response_length: int) -> AgentLoop:
    """An AgentLoop from the ``actor_rollout_ref.rollout.multi_turn`` config section."""
    if multi_turn.use_inference_chat_template:
        raise NotImplementedError("multi_turn.use_inference_chat_template=True (re-templating every turn) is not "
                                  "implemented: hybridrl keeps the generated token ids; set it to False")
    if not hasattr(engine, "generate_tensors"):
        raise NotImplementedError(f"multi_turn.enable=True needs the native rollout engine (rollout.name=native); "
                                  f"{type(engine).__name__} has no generate_tensors")
    if not (multi_turn.tool_config_path or multi_turn.interaction_config_path):
        raise ValueError("multi_turn.enable=True needs multi_turn.tool_config_path and/or interaction_config_path")
    tools = load_tool_config(multi_turn.tool_config_path) if multi_turn.tool_config_path else None
    interactions = load_interaction_config(multi_turn.interaction_config_path) \
        if multi_turn.interaction_config_path else None
    config = AgentLoopConfig(
        response_length=response_length, max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns, max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side,
        max_parallel_calls=multi_turn.max_parallel_calls, format=multi_turn.format)
    loop = AgentLoop(engine, tokenizer, config, tools, interactions)
    loop.encoder.check(multi_turn.tokenization_sanity_check_mode)
    return loop
