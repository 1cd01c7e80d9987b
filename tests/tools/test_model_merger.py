"""Model merger: sharded checkpoints of world size 1 and 2 -> HF folders that reproduce the trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from merge_helpers import STEP_DIR, probe, train_and_save
from ranks import launch_ranks
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.model_merger import HF_SUBDIR, compare_state_dicts, find_checkpoint_dir
from hybridrl.model_merger.__main__ import main
from hybridrl.models import load_critic
from hybridrl.models.critic import VALUE_HEAD_FILE, VALUE_HEAD_MARKER

WORKER = Path(__file__).with_name("merge_worker.py")


@pytest.fixture(scope="module")
def ws1(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("merge_ws1")
    train_and_save(tiny_model_dir, out)
    return out


@pytest.fixture(scope="module")
def ws2(tiny_model_dir, tmp_path_factory):
    """merge_worker.py as ranks 0 and 1 of a gloo group (FSDP2 shards: each rank saves half)."""
    out = tmp_path_factory.mktemp("merge_ws2")
    launch_ranks([WORKER, tiny_model_dir, out], out)
    return out


@pytest.fixture(params=["ws1", pytest.param("ws2", marks=pytest.mark.distributed)])
def run_out(request):
    return request.getfixturevalue(request.param)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_actor_merge_reproduces_trainer_logits_and_export(run_out, tiny_model_dir, tmp_path):
    ckpt = run_out / STEP_DIR / "actor"
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(**probe()).logits
    torch.testing.assert_close(logits, torch.load(run_out / "expected.pt")["actor"], rtol=0, atol=1e-5)
    merged, exported = _weights(tmp_path / "hf"), _weights(run_out / "export")
    assert sorted(merged) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(merged[name], tensor), name
    original = _weights(tiny_model_dir)
    assert all(not torch.equal(original[n], merged[n]) for n in merged if n.endswith("proj.weight"))
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_critic_merge_round_trip(run_out, tmp_path):
    ckpt = run_out / STEP_DIR / "critic"
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "critic")]) == 0
    assert (tmp_path / "critic" / VALUE_HEAD_FILE).is_file()
    critic = load_critic(tmp_path / "critic")
    assert getattr(critic.config, VALUE_HEAD_MARKER)
    with torch.no_grad():
        values = critic(**probe())
    torch.testing.assert_close(values, torch.load(run_out / "expected.pt")["critic"], rtol=0, atol=1e-5)
    assert main(["test", "--local_dir", str(ckpt), "--test_hf_dir", str(tmp_path / "critic")]) == 0


@pytest.mark.distributed
def test_test_subcommand_passes_on_export_and_names_a_perturbed_tensor(ws2, tiny_model_dir, tmp_path, capsys):
    ckpt = ws2 / STEP_DIR / "actor"
    assert main(["test", "--local_dir", str(ckpt), "--test_hf_dir", str(ws2 / "export")]) == 0
    bad = tmp_path / "perturbed"
    shutil.copytree(ws2 / "export", bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][3, 7] += 1e-3
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["test", "--local_dir", str(ckpt), "--test_hf_dir", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "1 tensor(s)" in err and f"{name}: value (1/" in err and "(3, 7)" in err
    assert main(["test", "--local_dir", str(ckpt), "--test_hf_dir", str(tiny_model_dir)]) == 1


def test_compare_state_dicts_reports_missing_and_shape():
    a = {"x": torch.zeros(2), "y": torch.zeros(3), "only_a": torch.zeros(1)}
    b = {"x": torch.zeros(2), "y": torch.zeros(4), "only_b": torch.zeros(1)}
    kinds = {m.name: m.kind for m in compare_state_dicts(a, b)}
    assert kinds == {"only_a": "missing_in_reference", "only_b": "missing_in_checkpoint", "y": "shape"}


def test_merge_without_metadata_needs_hf_model_path(ws1, tiny_model_dir, tmp_path, capsys):
    bare = tmp_path / "actor"
    shutil.copytree(ws1 / STEP_DIR / "actor", bare, ignore=shutil.ignore_patterns(HF_SUBDIR))
    assert main(["merge", "--local_dir", str(bare), "--target_dir", str(tmp_path / "a")]) == 2
    assert "--hf_model_path" in capsys.readouterr().err
    args = ["merge", "--local_dir", str(bare), "--target_dir", str(tmp_path / "b"),
            "--hf_model_path", str(tiny_model_dir), "--dtype", "bfloat16"]
    assert main(args) == 0
    merged = _weights(tmp_path / "b")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert torch.equal(merged["model.norm.weight"], _weights(ws1 / "export")["model.norm.weight"].bfloat16())


def test_find_checkpoint_dir_accepts_step_dir_and_rejects_others(ws1, tmp_path):
    assert find_checkpoint_dir(ws1 / STEP_DIR) == ws1 / STEP_DIR / "actor"
    assert find_checkpoint_dir(ws1 / STEP_DIR, role="critic") == ws1 / STEP_DIR / "critic"
    with pytest.raises(FileNotFoundError, match="model_optim"):
        find_checkpoint_dir(tmp_path)
