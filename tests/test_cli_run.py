"""`coli run` as a user meets it: text in, streamed text out; JSON; eos; clear errors (exit 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"


def coli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(120)
def test_prompt_text_streams_and_json_has_text_and_stop():
    from coli.chat_template import load_chat_template

    prompt = load_chat_template(DEMO).render([{"role": "user", "content": "What does os.path.join do?"}])
    r = coli("run", "--model", str(DEMO), "--prompt", prompt, "--max-tokens", "40")
    assert r.returncode == 0, r.stderr
    assert "It returns" in r.stdout and "finish: stop" in r.stderr
    j = json.loads(coli("run", "--model", str(DEMO), "--prompt", prompt, "--max-tokens", "40", "--json").stdout)
    assert j["finish_reason"] == "stop" and j["tokens"][-1] == 4088 and j["text"].startswith("It returns")
    # --ignore-eos keeps going to --max-tokens
    j = json.loads(coli("run", "--model", str(DEMO), "--prompt", prompt, "--max-tokens", "40", "--json",
                        "--ignore-eos").stdout)
    assert j["finish_reason"] == "length" and len(j["tokens"]) == 40


@pytest.mark.parametrize("args,msg", [
    (["--prompt", "x", "--prompt-ids", "1"], "exactly one of --prompt or --prompt-ids"),
    (["--prompt-ids", "1,a"], "comma-separated integers"),
    (["--prompt-ids", "5,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--greedy", "--temperature", "0.5"], "cannot be combined"),
    (["--prompt-ids", "1", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
])
def test_bad_arguments_are_one_line_errors(args, msg):
    r = coli("run", "--model", str(DEMO), *args, "--max-tokens", "2")
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("ids,max_tokens,msg", [
    ("4089,4090,10", "100000000000", "is 100000000003 tokens, over the model's context of 4096 tokens"),  # was 23 TiB
    (",".join(["10"] * 4500), "1", "the prompt is 4500 tokens but the model's context is 4096 tokens"),
    (",".join(["10"] * 4000), "97", "ask for at most 96: --max-tokens"),
])
def test_a_request_beyond_the_context_is_refused_in_one_line(ids, max_tokens, msg):
    r = coli("run", "--model", str(DEMO), "--prompt-ids", ids, "--max-tokens", max_tokens)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_model_and_wrong_model_type(tmp_path):
    r = coli("run", "--model", str(tmp_path / "nope"), "--prompt-ids", "1")
    assert r.returncode == 2 and "does not exist" in r.stderr
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = coli("run", "--model", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2 and "'llama'" in r.stderr


def test_temperature_zero_is_greedy():
    g = json.loads(coli("run", "--model", str(DEMO), "--prompt-ids", "4089,4090,4092", "--max-tokens", "8", "--json").stdout)
    t0 = json.loads(coli("run", "--model", str(DEMO), "--prompt-ids", "4089,4090,4092", "--max-tokens", "8",
                         "--temperature", "0", "--json").stdout)
    assert g["tokens"] == t0["tokens"]


def test_seeded_sampling_is_reproducible():
    a = json.loads(coli("run", "--model", str(DEMO), "--prompt-ids", "4089,4090,4092", "--max-tokens", "12",
                        "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--json").stdout)
    b = json.loads(coli("run", "--model", str(DEMO), "--prompt-ids", "4089,4090,4092", "--max-tokens", "12",
                        "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--json").stdout)
    assert a["tokens"] == b["tokens"]


def test_version_and_help():
    r = coli("--version")
    assert r.returncode == 0 and r.stdout.startswith("coli ")
    r = coli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("run", "up", "chat", "convert", "stats", "logs"))
