"""SFT trainer: loss masking, micro-batch invariance, a short run on the tiny model, checkpoints,
resume, the exported HF folder, and the config/CLI boundary."""

import json
import os
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.config.errors import ConfigError, ConfigWarning
from hybridrl.config.sft_schema import load_sft_config
from hybridrl.data.preprocess import prepare
from hybridrl.data.sft_dataset import SFTDataset
from hybridrl.engine import TrainEngine
from hybridrl.models import build_tiny_model, build_tiny_tokenizer, load_tokenizer, make_tiny_model_dir
from hybridrl.trainer import checkpoint as ckpt
from hybridrl.trainer.main_sft import build_engine, build_loaders, main
from hybridrl.trainer.sft_trainer import SFTTrainer, sft_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHATS = [
    [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
     {"role": "user", "content": "and 40+5="}, {"role": "assistant", "content": "45"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 1 2"},
     {"role": "assistant", "content": "1 2 3"}],
    [{"role": "user", "content": "reverse 1234"}, {"role": "assistant", "content": "4321"}],
    [{"role": "user", "content": "7+8="}, {"role": "assistant", "content": "15"},
     {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes 15"}],
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # other test processes share the 2 cores: two torch threads each made these steps 2-3x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat_batch(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    ds = SFTDataset(path, build_tiny_tokenizer(), multiturn=True)
    return ds.collate(ds.__getitems__(range(len(CHATS))))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = make_tiny_model_dir(root / "tiny", preset="tiny")
    data = prepare("addition", root / "data", n=1024, n_test=64, seed=0, max_digits=2)
    return root, model, data


def step_loss(engine, batch, **micro):
    tokens = float(batch.batch["response_mask"].sum())
    return engine.train_step(batch, lambda out, mb: sft_loss(out["log_probs"], mb.batch["response_mask"], tokens), **micro)


def forward_loss(engine, batch):
    tokens = float(batch.batch["response_mask"].sum())
    return float(sft_loss(engine.forward(batch).batch["log_probs"], batch.batch["response_mask"], tokens)[0])


def hf_sft_loss(model, batch):
    """The usual HF SFT loss: shifted cross-entropy with labels -100 except on loss-carrying tokens."""
    p = batch.batch["prompts"].shape[1]
    labels = torch.full_like(batch.batch["input_ids"], -100)
    labels[:, p:] = torch.where(batch.batch["response_mask"].bool(), batch.batch["responses"], -100)
    logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def test_loss_is_token_mean_nll_of_assistant_tokens_only(chat_batch):
    reference = build_tiny_model("tiny", seed=0).eval()
    with torch.no_grad():
        expected = float(hf_sft_loss(reference, chat_batch))
    engine = TrainEngine(build_tiny_model("tiny", seed=0), lr=0.0)
    assert step_loss(engine, chat_batch)["loss"] == pytest.approx(expected, rel=1e-5)
    assert forward_loss(engine, chat_batch) == pytest.approx(expected, rel=1e-5)


def test_changing_a_user_token_target_leaves_loss_unchanged_an_assistant_one_changes_it(chat_batch):
    engine = TrainEngine(build_tiny_model("tiny", seed=0), lr=0.0)
    mask = chat_batch.batch["response_mask"]
    user_pos = (chat_batch.batch["attention_mask"][0, -mask.shape[1]:].bool() & ~mask[0].bool()).nonzero()[0, 0]
    assistant_pos = mask[0].nonzero()[0, 0]

    def loss_with_target(pos):
        batch = chat_batch.select()
        batch.batch["responses"] = batch.batch["responses"].clone()
        batch.batch["responses"][0, pos] = (batch.batch["responses"][0, pos] + 7) % 1024  # the target only
        return forward_loss(engine, batch)

    base = forward_loss(engine, chat_batch)
    assert loss_with_target(user_pos) == pytest.approx(base, abs=1e-7)
    assert abs(loss_with_target(assistant_pos) - base) > 1e-4


def test_micro_batching_and_token_budget_do_not_change_loss_or_update(chat_batch):
    results = []
    for micro in ({}, {"micro_batch_size": 1}, {"max_token_len": 40}):
        engine = TrainEngine(build_tiny_model("tiny", seed=0), lr=1e-2, grad_clip=None)
        out = step_loss(engine, chat_batch, **micro)
        results.append((out, torch.cat([p.detach().flatten() for p in engine.model.parameters()])))
    assert results[1][0]["num_micro_batches"] == len(CHATS) and results[2][0]["num_micro_batches"] > 1
    for out, params in results[1:]:
        assert out["loss"] == pytest.approx(results[0][0]["loss"], rel=1e-5)
        assert out["grad_norm"] == pytest.approx(results[0][0]["grad_norm"], rel=1e-4)
        # Adam's first step is about lr * sign(grad): where a gradient is ~0 its float rounding
        # decides the sign, so the updates are compared to 1% of the step size
        torch.testing.assert_close(params, results[0][1], rtol=0, atol=1e-2 * 1e-2)


def sft_overrides(workdir, run, steps, **extra):
    root, model, data = workdir
    items = {
        "data.train_files": str(data["train"]), "data.val_files": str(data["test"]), "data.prompt_key": "prompt",
        "data.response_key": "extra_info", "+data.response_dict_keys": "[solution]", "data.max_length": 64,
        "data.train_batch_size": 64, "data.micro_batch_size_per_gpu": 32, "model.partial_pretrain": str(model),
        "optim.lr": 3e-3, "optim.warmup_steps_ratio": 0.0, "trainer.total_training_steps": steps,
        "trainer.default_local_dir": str(root / run), "trainer.device": "cpu", "trainer.logger": "[console,file]",
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_on_tiny_model_lowers_val_loss_saves_and_exports(workdir):
    config = load_sft_config(sft_overrides(workdir, "run", 24, **{"trainer.save_freq": 12, "trainer.test_freq": 12,
                                                                 "trainer.val_before_train": True}))
    tokenizer = load_tokenizer(config.model.partial_pretrain)
    train, val = build_loaders(config, tokenizer)
    engine = build_engine(config, 24)
    run_dir = workdir[0] / "run"
    from hybridrl.trainer.tracking import Tracking

    tracking = Tracking(["file"], run_dir)
    final = SFTTrainer(config, engine, tokenizer, train, val, tracking, run_dir).fit()
    tracking.close()
    vals = [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m]
    assert len(vals) == 3 and vals[-1] < vals[0] - 1.0, vals
    assert final["val/loss"] == pytest.approx(vals[-1]) and final["training/global_step"] == 24
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["global_step_12", "global_step_24"]
    assert (run_dir / ckpt.TRACKER_FILE).read_text() == "24"
    # the exported folder is a plain HF model with the trained weights
    reloaded = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model").eval()
    ids = torch.tensor([[1, 88, 300, 17, 2, 5]])
    engine.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, engine.model(ids).logits)
    assert load_tokenizer(run_dir / "hf_model").chat_template == tokenizer.chat_template


def test_cli_runs_then_resumes_from_its_checkpoint(workdir, capsys):
    run_dir = workdir[0] / "cli"
    assert main(sft_overrides(workdir, "cli", 2, **{"trainer.save_freq": 1})) == 0
    assert main(sft_overrides(workdir, "cli", 3, **{"trainer.save_freq": 1})) == 0
    assert "resumed from" in capsys.readouterr().out
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == [1, 2, 3]  # the second run continued at step 3 instead of starting over
    assert (run_dir / "hf_model" / "config.json").is_file() and (run_dir / "config.yaml").is_file()


def test_config_errors_name_keys_and_arithmetic():
    with pytest.raises(ConfigError, match=r"data.train_batch_size / world size = 10 / 1 = 10 is not a multiple of "
                                          r"data.micro_batch_size_per_gpu=4"):
        load_sft_config(["data.train_batch_size=10"])
    with pytest.raises(ConfigError, match=r"unknown key data.respons_key; did you mean data.response_key"):
        load_sft_config(["data.respons_key=x"])
    with pytest.raises(ConfigError, match=r"optim.lr_scheduler=wsd is not supported"):
        load_sft_config(["optim.lr_scheduler=wsd"])
    with pytest.raises(ConfigError, match=r"model.lora_rank is not supported"):
        load_sft_config(["model.lora_rank=32"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_sft_config(["optim.warmup_style=constant", "use_remove_padding=true", "model.lora_rank=0",
                               "data.micro_batch_size=8", "+model.use_remove_padding=true"])
    messages = [str(w.message) for w in caught if w.category is ConfigWarning]
    # verl's SFT trainer never reads the deprecated global micro batch either
    assert any("data.micro_batch_size has no effect" in m for m in messages) and cfg.data.micro_batch_size_per_gpu == 4
    assert any("renamed in verl to optim.lr_scheduler" in m for m in messages)
    assert any("use_remove_padding has no effect" in m for m in messages)
    assert any("model.use_remove_padding has no effect" in m for m in messages)
    assert cfg.optim.lr_scheduler == "constant" and cfg.data.multiturn.messages_key == "messages"
