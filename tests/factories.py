"""Small random base models and PEFT adapters, built in-process for tests (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCH_CONFIGS = {
    # Hidden sizes that are not powers of two; GQA (3:1), MQA and MHA; tied and untied embeddings.
    "llama": dict(
        model_type="llama", hidden_size=96, intermediate_size=200, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=80, intermediate_size=144, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True,
    ),
    "mistral": dict(
        model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, sliding_window=None,
    ),
}


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int | None = None, **overrides) -> Path:
    """Save a random transformers model of the given family to out_dir (config + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCH_CONFIGS[arch])
    spec.update(overrides)
    model_type = spec.pop("model_type")
    spec.setdefault("vocab_size", 257)
    spec.setdefault("max_position_embeddings", 512)
    spec.setdefault("rms_norm_eps", 1e-6)
    spec.setdefault("eos_token_id", 2)
    spec.setdefault("bos_token_id", 1)
    config = AutoConfig.for_model(model_type, **spec)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and some weights tiny; perturb so every weight matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def make_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    r: int = 8,
    target_modules=("q_proj", "v_proj"),
    lora_alpha: int | float = 16,
    seed: int | None = None,
    **lora_kwargs,
) -> Path:
    """Make a PEFT LoRA adapter on the model in model_dir with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                     **lora_kwargs)
    peft_model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                # PEFT initialises B to zero; random B makes the adapter change the output.
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def edit_adapter_config(adapter_dir: Path, **changes) -> None:
    """Rewrite fields of adapter_config.json (to build adapters that must be refused)."""
    path = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# ChatML, as SmolLM2 and Qwen2 use: the template writes every special token itself.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, how are you today?",
    "LoRA adapters share one base model.", "Paged attention reads keys and values through block tables.",
    "Bonjour le monde, comment allez-vous ?", "def f(x):\n    return x * 2\n",
]
TINY_TOKENIZER_VOCAB = 320


def add_tiny_tokenizer(model_dir: Path) -> Path:
    """Save a byte-level BPE tokenizer (trained here, every byte a token) with a ChatML chat template
    into model_dir. Ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (the tiny models' EOS).
    The model's vocab_size must be at least TINY_TOKENIZER_VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TOKENIZER_VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_TOKENIZER_CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(model_dir)
    return Path(model_dir)


def make_chat_model(out_dir: Path) -> Path:
    """The tiny Llama with a trained tokenizer and chat template that the server and dashboard tests use."""
    d = make_tiny_model(out_dir, "llama", seed=7, vocab_size=TINY_TOKENIZER_VOCAB, max_position_embeddings=256)
    return add_tiny_tokenizer(d)
