import json
import math
import sys

import pytest

from hybridrl.trainer.tracking import Tracking


def test_file_and_console_backends(tmp_path, capsys):
    tr = Tracking(["console", "file"], tmp_path)
    tr.log({"actor/pg_loss": 0.5, "val-core/x/acc/mean@1": 1.0, "bad": float("nan"), "skip": "text"}, step=3)
    tr.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 3 and rec["actor/pg_loss"] == 0.5 and rec["bad"] == "nan"
    assert "skip" not in rec
    out = capsys.readouterr().out
    assert "step:3" in out and "actor/pg_loss:0.5" in out
    assert math.isnan(float(rec["bad"]))


def test_unknown_backend_names_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="console"):
        Tracking(["consle"], tmp_path)


def test_missing_package_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if absent
    with pytest.raises(RuntimeError, match=r"pip install 'hybridrl\[wandb\]'"):
        Tracking(["wandb"], tmp_path)
