"""Writes the tiny model that tests/vllm_server.py serves with vLLM: run with the vLLM virtualenv's
Python (it needs torch, transformers and tokenizers, which apsd's own environment does not have)::

    $APSD_VLLM_PYTHON tests/vllm_model.py DIR

Nothing comes from a model hub. ``DIR`` receives a Hugging Face model folder (``config.json``, the
weights as safetensors, ``tokenizer.json`` and its config with a ChatML chat template):

* the tokenizer: a byte-level BPE (as GPT-2's and Llama 3's) with a vocabulary of
  :data:`VOCAB_SIZE`, trained here on generated English-like text, plus the special tokens
  ``<|endoftext|>`` (end of sequence), ``<|im_start|>`` and ``<|im_end|>``;
* the model: a Llama (hidden 128, 2 layers, 4 heads of 32: vLLM's CPU attention refuses heads
  smaller than 32, 8,192 positions) with random weights, in float32.

Its output never ends early and reads like words: the output projection has zero rows for the
special tokens (their logit is always 0) and for every token that is not a whole word after a
space (``Ġword``), and rows of length :data:`LOGIT_SCALE` in ``+v``/``-v`` pairs for those words,
so that for any hidden state some word scores far above 0 (~3 x the scale) and end of sequence is
never sampled. A completion therefore runs to ``max_tokens``, and its text, words each after a
space, tokenizes back to the tokens generated (as a real model's text mostly does), so a count of
the text by the server's ``/tokenize`` can be compared with what it generated.

The same arguments write the same files (fixed seeds), in 10-25 s on a 2-core machine.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

#: The served vocabulary's size (BPE pieces and special tokens).
VOCAB_SIZE = 2048
#: The longest sequence the model takes (a server may serve less: ``--max-model-len``).
MAX_POSITIONS = 8192
#: The length of each word's output-projection row (see the module docstring).
LOGIT_SCALE = 16.0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: ChatML, as Qwen's models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SYLLABLES = ("ka ri to ne su mo la vi de po an el is or un th er in on at es ti ma lo ba co fe gu "
              "hi ju ke ly my na pe qu ro sa tu ve wa xe yo ze").split()


def corpus(seed: int = 0, sentences: int = 20_000) -> list[str]:
    """Generated English-like text: words of 1-4 syllables, sentences of 4-16 words."""
    rng = random.Random(seed)
    lexicon = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)})
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]   # Zipf: common words become tokens
    lines = []
    for _ in range(sentences):
        words = rng.choices(lexicon, weights, k=rng.randint(4, 16))
        lines.append(" ".join(words).capitalize() + rng.choice(".,;!?") + "\n")
    return lines


def write(out: Path, *, seed: int = 0) -> None:
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)

    vocab = tokenizer.get_vocab()
    n_vocab = tokenizer.get_vocab_size()
    # Whole words after a space: "Ġ" then letters only. Their re-tokenization is themselves.
    words = sorted(i for piece, i in vocab.items() if piece.startswith("\u0120") and piece[1:].isalpha()
                   and tokenizer.encode(" " + piece[1:]).ids == [i])

    torch.manual_seed(seed)
    hidden, heads = 128, 4
    config = LlamaConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=None, eos_token_id=vocab["<|endoftext|>"],
                         pad_token_id=vocab["<|endoftext|>"], tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    pairs = len(words) // 2
    directions = rng.standard_normal((pairs, hidden))
    directions *= LOGIT_SCALE / np.linalg.norm(directions, axis=1, keepdims=True)
    output = np.zeros((n_vocab, hidden), dtype=np.float32)
    output[words[0:2 * pairs:2]] = directions
    output[words[1:2 * pairs:2]] = -directions
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(output))
    model.save_pretrained(out, safe_serialization=True)
    (out / "apsd-tiny-model.json").write_text(json.dumps({"words": len(words), "vocab": n_vocab}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm_model.py DIR")
    write(Path(sys.argv[1]))
