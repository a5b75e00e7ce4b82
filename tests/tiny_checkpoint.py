"""Tiny random Llama-family checkpoints (HF folder: config.json + model.safetensors + tokenizer with a chat
template) for fast tests of the model, engine and HTTP server.

The tokenizer is a byte-level BPE trained in memory on a few sentences, so any text encodes. Special tokens:
<|endoftext|> (0, pad), <|im_start|> (1, bos), <|im_end|> (2, eos). The chat template is ChatML."""

from __future__ import annotations

from pathlib import Path

import torch

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Prefix reuse skips recomputing the attention state of a shared prompt.",
    "What is the capital of France? The capital of France is Paris.",
    "user assistant system: hello, how are you today? I am fine, thank you!",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ? !",
    "Retrieval augmented generation puts documents into the prompt before the question.",
]


def build_tokenizer(vocab_size: int = 320):
    """A PreTrainedTokenizerFast with bos/eos/pad and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )


def tiny_hf_config(
    arch: str = "llama",
    vocab_size: int = 320,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    max_position_embeddings: int = 4096,
    layer_types: list[str] | None = None,
):
    """arch: llama, qwen2, qwen3, mistral, or gemma3 (Gemma 3's text model: with `sliding_window`, its
    layer_types sliding but every sixth, unless given; the sliding layers' RoPE base 10,000)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope)
    if arch == "mistral":
        return MistralConfig(**common, rope_parameters=rope, sliding_window=sliding_window)
    if arch == "qwen3":  # its head_dim defaults to 128, not hidden / heads
        return Qwen3Config(**common, rope_parameters=rope, head_dim=hidden_size // num_heads,
                           sliding_window=sliding_window, use_sliding_window=sliding_window is not None,
                           max_window_layers=num_layers // 2, layer_types=layer_types)
    if arch == "gemma3":
        # query_pre_attn_scalar differs from head_dim, so a forward scaling by head_dim^-0.5 fails the tests
        return Gemma3TextConfig(**common, head_dim=hidden_size // num_heads, query_pre_attn_scalar=24,
                                sliding_window=sliding_window or 4096, layer_types=layer_types,
                                rope_parameters={"full_attention": rope,
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raise ValueError(f"unknown arch {arch!r}")


def tiny_gemma3_multimodal_config(vocab_size: int = 320, **shape):
    """Gemma 3's multimodal layout (4B and up): the text model of tiny_hf_config("gemma3") under text_config,
    beside a one-layer SigLIP vision tower that the engine does not run."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text = tiny_hf_config("gemma3", vocab_size=vocab_size, **shape)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=3,
                        boi_token_index=4, eoi_token_index=5, eos_token_id=[2])


def write_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, **shape) -> Path:
    """Write a random fp32 checkpoint plus the tiny tokenizer into `path`; return it. `shape` takes
    tiny_hf_config's keyword arguments (num_layers, hidden_size, rope_scaling, ...).
    Same arguments and seed -> same weights. arch "gemma3-multimodal": tiny_gemma3_multimodal_config."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    if arch == "gemma3-multimodal":
        config = tiny_gemma3_multimodal_config(vocab_size=len(tokenizer), **shape)
    else:
        config = tiny_hf_config(arch, vocab_size=len(tokenizer), **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled so attention is neither uniform nor one-hot, norms and biases non-trivial: a bug in
    any of them changes the logits well beyond the tests' tolerance."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.3 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)
