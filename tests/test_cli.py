"""`tandem generate` and logging, as a user runs them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from tandem.logs import JsonFormatter


def tandem(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_answers_paris(smollm):
    out = tandem("generate", "What is the capital of France?", "--json", "--max-tokens", "32")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"prompt_ids", "output_ids", "text", "finish_reason"}
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "stop"
    assert not set(result["output_ids"]) & smollm.tokenizer.eog_ids  # the EOS token is not part of the output
    assert smollm.tokenizer.decode(result["output_ids"]) == result["text"]
    # The chat template was applied: the prompt starts with the default system prompt.
    assert smollm.tokenizer.decode(result["prompt_ids"], skip_special=False).startswith("<|im_start|>system")


def test_generate_raw_and_length(smollm):
    out = tandem("generate", "The capital of France is", "--raw", "--json", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == smollm.tokenizer.encode("The capital of France is")
    assert result["finish_reason"] == "length" and len(result["output_ids"]) == 3


def test_generate_bad_model_and_request_are_clear_errors():
    out = tandem("generate", "hi", "--model", "/no/such/model.gguf")
    assert out.returncode == 2 and "neither a known alias" in out.stderr
    out = tandem("generate", "hi", "--max-tokens", "100000")
    assert out.returncode == 2 and "exceeds the context length" in out.stderr


def test_json_log_lines_carry_the_request_id():
    record = logging.LogRecord("actors.decode", logging.INFO, __file__, 1, "request %s: local prefill", ("r1",), None)
    record.request_id = "r1"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "request r1: local prefill"
    assert entry["request_id"] == "r1" and entry["level"] == "info" and entry["logger"] == "actors.decode"
