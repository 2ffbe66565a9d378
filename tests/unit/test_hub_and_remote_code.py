"""--push_to_hub and --trust_remote_code, in-process: what is refused before launch, and an upload that fails after
training. (Launched: the upload of a 2-process run, tests/e2e/test_cli.py::test_sft_writes_model_config_and_metrics;
a failed upload after a TRL recipe's run, tests/e2e/test_trl_recipe.py; steps and the export of a model with its own
code, tests/e2e/test_cli.py::test_yaml_recipe_with_flag_override.)"""

from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants as hub_constants

from shardtune.config.flags import parse_args, to_yaml
from shardtune.publishing.hub import HubUploadError, push_model
from tests.conftest import main_in_process
from tests.helpers import write_remote_code_model
from tests.hub_standin import HubStandIn


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_push_to_hub_is_refused_before_launch_when_it_cannot_work(tiny_model, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(cache_dir))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    run = ("sft", "--model_name", tiny_model, "--output_dir", out, "--push_to_hub", "--hub_model_id", "me/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    line = _one_line_error(main_in_process(*run))
    assert "HF_HUB_OFFLINE is set" in line and f"hf upload me/model {out}" in line
    # online, but no token anywhere (HF_TOKEN unset, no saved login)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    line = _one_line_error(main_in_process(*run))
    assert "no Hugging Face token" in line and "--hub_token" in line
    assert not out.exists()  # refused before anything ran
    # a hub setting without --push_to_hub would be accepted and ignored: refused
    assert "only applies with --push_to_hub" in _one_line_error(
        main_in_process("sft", "--model_name", tiny_model, "--output_dir", out, "--hub_model_id", "me/model")
    )


def test_the_hub_token_is_never_written_to_config_yaml():
    cfg = parse_args(["--push_to_hub", "--hub_token", "hf_secret_value", "--hub_private_repo"])
    assert cfg.output.hub_token == "hf_secret_value" and cfg.output.hub_private_repo
    assert "hf_secret_value" not in to_yaml(cfg)


def test_a_failed_upload_keeps_the_model_and_says_how_to_upload_it(tiny_model, tmp_path, monkeypatch):
    out = shutil.copytree(tiny_model, tmp_path / "run")  # a published model folder
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cfg = parse_args(["--output_dir", str(out), "--push_to_hub", "--hub_private_repo"])
    with HubStandIn(refuse_commits=True) as hub:
        # huggingface_hub read HF_HUB_OFFLINE (set for the test session) and HF_ENDPOINT once, at import
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hub_constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin")
        with pytest.raises(HubUploadError) as error:
            push_model(cfg, sorted(before))
    assert hub.created == [{"name": "run", "organization": None, "visibility": "private"}]
    message = str(error.value)
    assert "\n" not in message and "uploading to tester/run failed" in message
    assert f"upload it by hand with hf upload tester/run {out}" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the run's model, untouched


def test_a_model_with_its_own_code_is_refused_without_trust_remote_code(tiny_model, cli_in_process, tmp_path):
    model = write_remote_code_model(tiny_model, tmp_path / "remote")
    line = _one_line_error(cli_in_process("sft", "--model_name", model, "--output_dir", tmp_path / "run"))
    assert f"--model_name {model}" in line and "(remote_llama)" in line and "pass --trust_remote_code" in line
    assert not (tmp_path / "run").exists()


def test_export_push_to_hub_is_refused_before_writing_when_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "exported"
    proc = main_in_process("export", tmp_path / "run", out, "--push_to_hub", "me/model")
    line = _one_line_error(proc)
    assert "HF_HUB_OFFLINE is set" in line and f"hf upload me/model {out}" in line
    assert not out.exists()
