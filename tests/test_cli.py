"""`tandem generate`, logging, and bad command-line input, as a user runs them."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from runtime.logs import JsonFormatter


def tandem(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


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


@pytest.mark.parametrize("args,env,code,says", [
    (["--log-level", "INFO", "generate", "hi", "--max-tokens", "-1"], {}, 2, "max_tokens must be at least 1"),
    (["--log-level", "bogus", "status"], {}, 2, "unknown log level 'bogus'"),
    (["status"], {"TANDEM_LOG_LEVEL": "loud"}, 2, "unknown log level 'loud'"),
    (["status", "--nats-url", "nats://127.0.0.1:abc"], {}, 2, "bad NATS URL nats://127.0.0.1:abc"),
    (["tail", "--nats-url", "nats://[::1"], {}, 2, "bad NATS URL"),
    (["status", "--nats-url", "http://127.0.0.1:4222"], {}, 2, "the scheme must be one of"),
    (["up", "--port", "70000"], {}, 1, "--port must be 0 (any free port) to 65535, got 70000"),
    (["up", "--nats-port", "70000"], {}, 1, "--nats-port must be 0"),
    (["up", "--metrics-port-base", "-5"], {}, 1, "--metrics-port-base must be 0"),
    (["up", "--ready-file", "/no/such/dir/ready.json"], {}, 1, "is not a writable folder"),
    (["up", "--aggregated", "--prefill", "2"], {}, 1, "--aggregated runs no prefill_only workers"),
    (["serve", "--num-blocks", "0"], {}, 2, "--num-blocks must be at least 1, got 0"),
    (["serve", "--metrics-port", "70000"], {}, 2, "--metrics-port must be 0 (none) to 65535"),
    (["serve", "--prefill-timeout", "0"], {}, 2, "--prefill-timeout must be positive"),
    (["serve", "--namespace", "a.b"], {}, 2, "namespace 'a.b' is not a subject token"),
    (["serve"], {"TANDEM_MAX_BATCH": "abc"}, 2, "TANDEM_MAX_BATCH must be an integer, got 'abc'"),
    (["serve"], {"TANDEM_ENABLE_PREFIX_CACHE": "flase"}, 2, "TANDEM_ENABLE_PREFIX_CACHE must be true or false"),
    (["--env-file", "/no/such/tandem.env", "status"], {}, 2, "--env-file /no/such/tandem.env: No such file"),
    (["--nats-user", "decode", "status"], {}, 2, "--nats-user decode: set TANDEM_NATS_PASSWORD_DECODE"),
])
def test_bad_input_is_one_clear_line_before_any_work(args, env, code, says):
    """No traceback, the right exit code, and no model loaded or cluster started first."""
    out = tandem(*args, timeout=60, env=env)
    assert out.returncode == code, (out.returncode, out.stderr)
    assert says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr


def test_busy_metrics_port_fails_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        out = tandem("--log-level", "INFO", "serve", "--metrics-port", str(port), timeout=60)
    assert out.returncode == 2 and f"cannot serve metrics on 0.0.0.0:{port}: " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr


def test_env_file_lines_and_what_the_command_line_makes_of_them(tmp_path):
    from runtime.settings import read_env_file

    good = tmp_path / "tandem.env"
    good.write_text("# passwords\n\nexport TANDEM_NAMESPACE=team-a\nTANDEM_NATS_PASSWORD_DECODE = 'p 1'\n"
                    "TANDEM_NATS_URL=\"nats://10.0.0.1:4222,nats://10.0.0.2:4222\"\n")
    assert read_env_file(good) == {"TANDEM_NAMESPACE": "team-a", "TANDEM_NATS_PASSWORD_DECODE": "p 1",
                                   "TANDEM_NATS_URL": "nats://10.0.0.1:4222,nats://10.0.0.2:4222"}
    bad = tmp_path / "bad.env"
    bad.write_text("A=1\nthis is not an assignment\n")
    with pytest.raises(ValueError, match="bad.env, line 2: not KEY=VALUE"):
        read_env_file(bad)
    out = tandem("--env-file", str(bad), "status", timeout=60)
    assert out.returncode == 2 and "line 2: not KEY=VALUE" in out.stderr, out.stderr
    # --nats-user finds its password in the file: the command gets as far as NATS
    out = tandem("--env-file", str(good), "--nats-user", "decode", "status", "--json", "--nats-url",
                 "nats://127.0.0.1:1", "--timeout", "1", timeout=60)
    assert out.returncode == 1 and "cannot reach NATS" in out.stderr, out.stderr
