"""A model-based reward: a sequence scorer whose output at a response's last token is its reward.

As in verl, the model loads as a one-label token classifier (``models.load_reward_model``) and its
score is placed at the last response token as ``rm_scores (B, R)``; the reward manager then takes
those scores in place of the rule-based ones. Where ``reward_model.model.input_tokenizer`` is set
(by default the policy's path) the policy's and the reward model's chat templates may differ, so
each row is re-written for the reward model first: the prompt's chat messages (``raw_prompt``, from
``data.return_raw_chat=true``), plus the response decoded with the policy's tokenizer as the
assistant's turn, through the reward model's chat template, cut to ``reward_model.max_length``
tokens (on the right). With ``input_tokenizer=null`` the policy's token ids are scored as they are.
"""

from __future__ import annotations

import torch

from hybridrl.algos.reward_shaping import scores_at_last_token
from hybridrl.engine.packing import real_lengths
from hybridrl.engine.train_engine import TrainEngine
from hybridrl.models import load_reward_model, load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.workers.common import import_external_lib, micro_batching, setup_distributed, sharding


class RewardModelWorker(Worker):
    """The reward model, sharded like the other roles and never stepped."""

    def __init__(self, config) -> None:
        setup_distributed()
        self.rm = config.reward_model
        import_external_lib("reward_model.model.external_lib", self.rm.model.external_lib)
        model = load_reward_model(self.rm.model.path, trust_remote_code=self.rm.model.trust_remote_code)
        model.requires_grad_(False)
        # lr 0 and no optimizer steps: the engine is used for its sharded, padding-free forward
        self.engine = TrainEngine(model, lr=0.0, model_type="reward", **sharding(self.rm.model.fsdp_config))
        self.tokenizers = None
        if self.rm.model.input_tokenizer is not None:
            trust = self.rm.model.trust_remote_code
            self.tokenizers = (load_tokenizer(self.rm.model.input_tokenizer, trust_remote_code=trust),
                               load_tokenizer(self.rm.model.path, trust_remote_code=trust))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores (B, R)``: each row's score at its last response token, 0 elsewhere."""
        batching = micro_batching(self.rm.use_dynamic_bsz, self.rm.micro_batch_size_per_gpu,
                                  self.rm.forward_max_token_len_per_gpu)
        if self.tokenizers is None:
            scores = self.engine.forward(data, **batching).batch["rm_scores"]
            return DataProto.from_dict({"rm_scores": scores})
        rewritten = retemplate(data, *self.tokenizers, self.rm.max_length)
        per_row = self.engine.forward(rewritten, **batching).batch["rm_scores"].sum(-1)  # one score a row
        width = data.batch["responses"].shape[1]
        lengths = real_lengths(data.batch["attention_mask"], width)[1]
        return DataProto.from_dict({"rm_scores": scores_at_last_token(per_row, lengths, width)})


def retemplate(data: DataProto, source, target, max_length: int | None) -> DataProto:
    """``data``'s rows re-written for a reward model with another chat template: ``raw_prompt``'s
    messages plus the response (decoded by ``source``, its EOS text removed) as the assistant's
    turn, through ``target``'s chat template and tokenizer, right-padded and cut on the right to
    ``max_length`` tokens (default: ``data``'s own width). The result is one right-padded sequence per
    row, in the training engine's layout with a one-token "prompt", so that its last real token is
    the sequence's."""
    if "raw_prompt" not in data.non_tensor_batch:
        raise KeyError("reward_model.model.input_tokenizer is set, so the reward model re-templates each row from "
                       "its chat messages, but the batch has no raw_prompt: set data.return_raw_chat=true "
                       "(or reward_model.model.input_tokenizer=null to score the policy's tokens as they are)")
    responses = data.batch["responses"]
    lengths = real_lengths(data.batch["attention_mask"], responses.shape[1])[1]
    width = max_length or data.batch["input_ids"].shape[1]
    rows = []
    for i, messages in enumerate(data.non_tensor_batch["raw_prompt"]):
        text = source.decode(responses[i, : int(lengths[i])].tolist())
        if source.eos_token:
            text = text.replace(source.eos_token, "")
        chat = [*list(messages), {"role": "assistant", "content": text}]
        templated = target.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        ids = target(templated, add_special_tokens=False)["input_ids"][:width]
        rows.append(ids or [target.pad_token_id or 0])
    pad = target.pad_token_id if target.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "responses": input_ids[:, 1:]})
