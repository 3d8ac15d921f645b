"""Tiny random models and tokenizers in the real on-disk formats, built offline for tests."""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "SELECT name FROM users WHERE age > 30;",
    "Ahoy matey, the sea be calm and the rum be sweet.",
    "Zürich, Köln, Øresund, 東京, ☃ and 🙂 are not ASCII.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(directory: str | Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer (multi-byte characters span tokens) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def make_tiny_model(
    directory: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_scaling: dict | None = None,
) -> Path:
    """Save a random Llama-family model plus tokenizer with `save_pretrained`; returns the directory.

    arch: "llama" (GQA, untied or tied), "qwen2" (q/k/v bias), "mistral".
    """
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        if rope_scaling is not None:
            config.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: list[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 1,
    use_rslora: bool = False,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    scale: float = 0.3,
    **config_overrides,
) -> Path:
    """Save a peft LoRA adapter with random, non-zero A and B for the model in base_dir."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        **config_overrides,
    )
    peft_model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)
