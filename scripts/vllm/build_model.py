#!/usr/bin/env python3
"""Build a tiny random-weight Llama model and its tokenizer offline, for the real-vLLM e2e suite.

Run it with the vLLM venv's python (it needs ``torch``, ``transformers`` and ``tokenizers``)::

    .cache/vllm-venv/bin/python scripts/vllm/build_model.py            # -> .cache/vllm-model/tiny-llama
    .cache/vllm-venv/bin/python scripts/vllm/build_model.py --force    # rebuild even if present

Nothing is downloaded. The tokenizer is a byte-level BPE trained with ``tokenizers`` on a corpus generated here
from a fixed seed (an embedded English word list plus seeded pseudo-words, numbers, punctuation and chat-ish
lines), so the vocabulary — and therefore every token count the fixtures record — is the same on every machine
and every Python version. The model is a ``LlamaForCausalLM`` (2 layers, hidden 128, 4 heads, intermediate 256)
with weights drawn from a fixed torch seed, saved as safetensors with a generation_config.json.

The output folder is reused when its ``build-info.json`` matches this recipe; a build goes to a temporary sibling
folder first and is renamed into place, so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / ".cache" / "vllm-model" / "tiny-llama"

# Bump when anything below changes the produced files.
RECIPE_VERSION = 3
SEED = 20240601
VOCAB_SIZE = 3072
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
)
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK, IM_START, IM_END]

# ChatML-style template; content is used as a plain string, so vLLM detects the "string" content format.
# The turn ends with EOS so a model that emits it stops cleanly.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by hot
word but what some we can out other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him two has look more day could
go come did number sound no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came show every good me give
our under name very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off need house picture
try us again animal point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never last let thought city
tree cross farm hard start might story saw far sea draw left late run while press close night real life few north
request server model token queue latency admission replica cluster stream class batch interactive internal reject
accept degrade shed prompt completion usage cache memory budget limit window deadline retry policy tenant header
""".split()
PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", '"', "'", "/", "{", "}", "[", "]", "=", "+", "*", "#", "%"]
ROLES = ["system", "user", "assistant"]


def _pseudo_word(rng: random.Random) -> str:
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rk", "x"]
    return "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                   for _ in range(rng.choice((1, 1, 2, 2, 3))))


def corpus(seed: int = SEED, lines: int = 30000) -> list[str]:
    """A deterministic training corpus: the same list of strings for the same seed, on any machine."""
    rng = random.Random(seed)
    pseudo = sorted({_pseudo_word(rng) for _ in range(3000)})
    out = []
    for i in range(lines):
        n = rng.randint(4, 18)
        toks = []
        for _ in range(n):
            r = rng.random()
            if r < 0.70:
                # Zipf-ish choice among real words so frequent words become single tokens.
                toks.append(WORDS[min(int(rng.paretovariate(1.1)) - 1, len(WORDS) - 1)]
                            if rng.random() < 0.5 else rng.choice(WORDS))
            elif r < 0.90:
                toks.append(rng.choice(pseudo))
            elif r < 0.97:
                toks.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
            else:
                toks.append(rng.choice(PUNCT))
        sentence = " ".join(toks)
        if rng.random() < 0.3:
            sentence = sentence.capitalize()
        sentence += rng.choice([".", ".", ".", "?", "!", ""])
        if i % 7 == 0:
            sentence = f"{IM_START}{rng.choice(ROLES)}\n{sentence}{IM_END}\n"
        out.append(sentence)
    return out


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0", pair=f"{BOS} $A:0 $B:1", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # Keep the chat template inside tokenizer_config.json as well (newer transformers write chat_template.jinja);
    # either is enough for vLLM, both make the folder readable by older and newer loaders alike.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return fast


def build_model(out_dir: Path, tokenizer) -> dict:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD))}
    config = LlamaConfig(vocab_size=len(tokenizer), **MODEL, **ids)
    torch.manual_seed(SEED)
    # Initialise in float32 (seeded), store as bfloat16: vLLM's CPU backend runs dtype=auto as bfloat16 anyway
    # and would otherwise log a cast warning per weight.
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    return {"vocab_size": len(tokenizer), "parameters": n_params, **ids}


def recipe() -> dict:
    return {"recipe_version": RECIPE_VERSION, "seed": SEED, "vocab_size_target": VOCAB_SIZE, "model": MODEL,
            "special_tokens": SPECIAL_TOKENS, "chat_template": CHAT_TEMPLATE}


def is_current(out_dir: Path) -> bool:
    info = out_dir / "build-info.json"
    need = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    if not info.is_file() or not all((out_dir / n).is_file() for n in need):
        return False
    try:
        return json.loads(info.read_text()).get("recipe") == recipe()
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even when the folder matches the recipe")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()

    if not args.force and is_current(out):
        print(f"[build_model] reusing {out}")
        return 0

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = build_tokenizer(tmp)
        t_tok = time.monotonic() - t0
        facts = build_model(tmp, tokenizer)
        (tmp / "build-info.json").write_text(json.dumps(
            {"recipe": recipe(), "facts": facts}, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dt = time.monotonic() - t0
    print(f"[build_model] built {out} in {dt:.1f}s (tokenizer {t_tok:.1f}s): "
          f"vocab {facts['vocab_size']}, {facts['parameters']:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
