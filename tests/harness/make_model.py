"""Write a tiny random-weight Llama model that vLLM can serve.

Run by the ENGINE venv's python (transformers, tokenizers and torch live there), never imported by the
watchdog's tests: `models.py` runs it as a script. Usage:

    python make_model.py --out DIR --hidden 128 --intermediate 256 --layers 2 --heads 4 --vocab 512

The tokenizer is a byte-level BPE trained on generated lowercase text. No digit occurs in that text, so
no merge contains a digit and every digit of a prompt is exactly one token: `load.long_prompt` relies on it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def training_text(seed: int, n_lines: int = 4000) -> list[str]:
    """Lines of made-up lowercase words with a little punctuation; deliberately no digits."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["the", "and", "ing", "tion"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    lines = []
    for _ in range(n_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
        lines.append(sentence + rng.choice([".", ",", "?", "!", ";"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int, max_length: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # type: ignore[import-not-found,unused-ignore]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--intermediate", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-positions", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(args.vocab, args.seed, args.max_positions)
    vocab = len(tokenizer)  # the trainer may stop a little short of the requested size
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    digits = tokenizer("0123456789", add_special_tokens=False)["input_ids"]
    assert len(digits) == 10, f"digits must be one token each, got {digits}"
    (args.out / "engine-watchdog-model.json").write_text(
        json.dumps({"tokenizer_vocab": vocab, **{k: v for k, v in vars(args).items() if k != "out"}}) + "\n"
    )


if __name__ == "__main__":
    main()
