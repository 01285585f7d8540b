"""`lorafleet scheduler` refuses to start, with status 2 and one error naming the file and the problem, when the
model's config.json or the API key file cannot be read as what it should be (instead of serving with a guessed
context length or with keys nobody meant)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from lorafleet.scheduler.api_keys import ApiKeyFileError, parse_keys
from lorafleet.scheduler.server import StartupError, model_display_name, model_limits

pytestmark = pytest.mark.timeout(60)


def model_with_config(root, demo_model, name: str, config: str | None):
    d = root / name
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / f, d / f)
    if config is not None:
        (d / "config.json").write_text(config)
    return d


def test_a_bad_config_file_stops_the_scheduler_with_status_2_and_the_reason(tmp_path, demo_model):
    good = model_with_config(tmp_path, demo_model, "good", json.dumps({"max_position_embeddings": 2048}))
    yaml_keys, json_keys = tmp_path / "keys.yaml", tmp_path / "keys.json"
    yaml_keys.write_text("api_keys:\n  - sk-team-a\n")
    json_keys.write_text('{"keys":["sk-a","sk-b"]}\n')
    cases = {  # name -> (arguments, words the error must contain)
        "config not JSON": (["--model", str(model_with_config(tmp_path, demo_model, "torn", '{"max_position'))],
                            ["torn/config.json", "not readable JSON"]),
        "config a list": (["--model", str(model_with_config(tmp_path, demo_model, "list", "[1, 2]"))],
                          ["list/config.json", "must hold a JSON object, found list"]),
        "context length a word": (
            ["--model", str(model_with_config(tmp_path, demo_model, "word", '{"max_position_embeddings": "lots"}'))],
            ["word/config.json", "max_position_embeddings", "'lots'"]),
        "keys in YAML": (["--model", str(good), "--api-keys", str(yaml_keys)],
                         [str(yaml_keys), "line 1", "looks like YAML or JSON"]),
        "keys in JSON": (["--model", str(good), "--api-keys", str(json_keys)],
                         [str(json_keys), "line 1", "looks like YAML or JSON"]),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "lorafleet", "scheduler", "--port", "0", *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (argv, _) in cases.items()}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=30)
            errors = [line for line in out.splitlines() if " ERROR " in line]
            assert proc.returncode == 2, (name, out)
            assert len(errors) == 1 and all(word in errors[0] for word in cases[name][1]), (name, out)
            assert "sk-" not in out, name  # a key file's lines are never echoed
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_key_files_in_the_documented_format_still_load():
    keys = parse_keys("sk-abc\nYWJjZA== pirate,base cache_group=t\nuser.key_1 max_concurrent=2 priority=1\n")
    assert len(keys) == 3


@pytest.mark.parametrize("text", ["keys:\n  - sk-a\n", "- sk-a\n", '["sk-a"]\n', "{sk-a}\n", "'sk-a'\n",
                                  'api_key="sk-a"\n'])
def test_yaml_or_json_is_not_read_as_keys(text):
    with pytest.raises(ApiKeyFileError, match="line 1: this looks like YAML or JSON"):
        parse_keys(text)


def test_model_config_is_read_or_refused(tmp_path):
    (tmp_path / "m").mkdir()
    assert model_limits(tmp_path / "m") == 4096 and model_display_name(tmp_path / "m") == "m"  # no config.json
    (tmp_path / "m" / "config.json").write_text('{"max_position_embeddings": 8192, "_name_or_path": "org/x"}')
    assert model_limits(tmp_path / "m") == 8192 and model_display_name(tmp_path / "m") == "x"
    for bad in ("{", "null", '{"max_position_embeddings": 0}', '{"max_position_embeddings": true}'):
        (tmp_path / "m" / "config.json").write_text(bad)
        with pytest.raises(StartupError, match="config.json"):
            model_limits(tmp_path / "m")
