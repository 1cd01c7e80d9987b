"""`hybridrl config show|check|keys` through the real CLI entry point, and docs/config.md kept in sync."""

from pathlib import Path

from omegaconf import OmegaConf

from hybridrl.cli import main as hybridrl_main
from hybridrl.config.cli import keys_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_show_prints_the_resolved_yaml(capsys):
    code = hybridrl_main(["config", "show", "--preset", "grpo_quickstart", "trainer.device=cpu", "data.max_response_length=40"])
    out = capsys.readouterr().out
    assert code == 0
    shown = OmegaConf.create(out)
    assert shown.actor_rollout_ref.rollout.response_length == 40 and shown.algorithm.adv_estimator == "grpo"


def test_check_reports_ok_and_errors(capsys):
    assert hybridrl_main(["config", "check", "--preset=grpo_quickstart", "trainer.device=cpu"]) == 0
    assert "config OK" in capsys.readouterr().out
    assert hybridrl_main(["config", "check", "--preset", "grpo_quickstart", "trainer.total_epoch=2"]) == 1
    assert "did you mean trainer.total_epochs" in capsys.readouterr().err


def test_warnings_go_to_stderr(capsys):
    assert hybridrl_main(["config", "check", "--preset", "grpo_quickstart", "trainer.device=cpu",
                          "actor_rollout_ref.actor.fsdp_config.use_orig_params=True"]) == 0
    assert "warning: " in capsys.readouterr().err


def test_unknown_subcommand(capsys):
    assert hybridrl_main(["config", "frobnicate"]) == 2


def test_docs_list_every_key_as_generated():
    generated = keys_markdown()
    assert "`actor_rollout_ref.rollout.val_kwargs.temperature`" in generated
    assert generated in DOCS.read_text(), "docs/config.md is stale: regenerate its key tables with `hybridrl config keys`"
