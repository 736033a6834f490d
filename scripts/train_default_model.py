#!/usr/bin/env python3
"""Train vtcore's embedded default model: a tiny Qwen3 trained on fortune cookies.

This script builds, from scratch and fully offline, the small checkpoint that
ships in ``vtcore/default_model/``. It is a real Qwen3 checkpoint with a real
tokenizer and a ChatML chat template, so it takes the same code paths as
any Hugging Face Qwen3 model: config parsing, safetensors loading, byte-level
BPE, chat templating, and greedy and sampled decoding. It is still far too small
to be useful as an assistant; it only produces English-looking text.

Corpus
------
The text is the English quotations, jokes and aphorisms in Debian's
``fortunes`` package (the data behind the classic ``fortune`` program). It is
about 2.6 MB of files under
``/usr/share/games/fortunes``. To get it, on Debian or Ubuntu::

    apt-get update && apt-get install -y fortunes     # (or just fortunes-min)

The files separate entries with ``%`` lines. The script removes those, strips
terminal overstrike sequences (``_\\bX``), tabs and repeated spaces, rejoins
hard-wrapped prose lines, and drops ASCII art and other entries that are
mostly not letters; what remains is ~15,000 entries, ~2.5 M characters
(~0.86 M tokens). 2% of the entries are held out to measure validation loss.
If the directory is missing or empty, the script stops with an error that says
how to install it. ``--fortunes-dir`` points the script at another folder.

Mixed into the plain text are ChatML conversations: a user asks for "a quote",
"a fortune", "a quote about love", "who are you?", and so on, and the
assistant answers with a corpus entry or a fixed short reply. That way the
model has seen ``<|im_start|>``/``<|im_end|>`` and answers a
chat-templated prompt a little.

Sizes
-----
* Tokenizer: byte-level BPE (``tokenizers``), Qwen2-style pre-tokenizer regex,
  2048 tokens, special tokens ``<|endoftext|>`` (0), ``<|im_start|>`` (1)
  and ``<|im_end|>`` (2). It is lossless for any UTF-8 text, non-ASCII included.
* Model: ``Qwen3ForCausalLM``, hidden 256, 4 layers, 4 query heads / 2 KV
  heads, head_dim 64, MLP 768, tied embeddings, RoPE theta 1e4, 1024
  positions, about 3.7M parameters, float32 (about 14.7 MB).
* Training: AdamW, 540 steps of 16 x 256 packed tokens (~2.2M tokens, about 2.4
  passes over the corpus), warmup then cosine learning-rate decay, seed 1234,
  one CPU thread. It takes about 15-20 minutes on one modern x86 core.

Output
------
``vtcore/default_model/`` (override with ``--out``) holds ``config.json``,
``generation_config.json``, ``model.safetensors`` (one file, no separate
``lm_head.weight``), ``tokenizer.json`` and ``tokenizer_config.json`` (which
contains the chat template). It loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``.

Usage
-----
From the repository root::

    python scripts/train_default_model.py            # full run, ~20 min
    python scripts/train_default_model.py --steps 20 --out /tmp/smoke   # quick smoke test

Requires ``torch``, ``transformers`` (>= 4.51, for Qwen3), ``tokenizers`` and
``safetensors``. Training uses a single CPU thread on purpose
(``torch.set_num_threads(1)``), so the machine stays usable.
"""

from __future__ import annotations

import os

# Pin every thread pool to one core *before* torch / tokenizers are imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "vtcore" / "default_model"
DEFAULT_FORTUNES_DIR = Path("/usr/share/games/fortunes")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

# Qwen2 / Qwen3 pre-tokenizer pattern (GPT-4 style, single digits).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML template, the same shape as Qwen's (without the tool-calling parts).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Files in the fortunes package that are not (mostly) English prose.
EXCLUDED_FORTUNE_FILES = {"ascii-art"}

# Files that contain only weights, config and tokenizer; anything else is removed.
OUTPUT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
MAX_FOLDER_BYTES = 16 * 1000 * 1000


@dataclass(frozen=True)
class TrainSettings:
    """Hyper-parameters of the run. The defaults produce the committed checkpoint."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 540
    warmup_steps: int = 30
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.25
    val_fraction: float = 0.02
    seed: int = 1234
    max_minutes: float = 20.0
    log_every: int = 10


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------

_OVERSTRIKE = re.compile(r".\x08")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPACES = re.compile(r"[ \t]+")


def clean_fortune(raw: str) -> str | None:
    """Normalise one fortune entry; return None if it is not usable English text."""
    text = raw
    while _OVERSTRIKE.search(text):  # "_\bW" style underlining / bold
        text = _OVERSTRIKE.sub("", text)
    text = text.replace("\t", " ")
    text = _CONTROL.sub("", text)
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    # Drop leading / trailing empty lines.
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        return None

    # Re-join hard-wrapped prose: a long line followed by a non-empty line that
    # is not an attribution ("-- Author") continues the same paragraph.
    # Short lines (poems, dialogue) keep their line breaks.
    merged: list[str] = [lines[0]]
    for line in lines[1:]:
        prev = merged[-1]
        if prev and line and len(prev) >= 55 and not line.startswith("--"):
            merged[-1] = prev + " " + line
        else:
            merged.append(line)
    # Collapse runs of blank lines to one.
    out: list[str] = []
    for line in merged:
        if not line and out and not out[-1]:
            continue
        out.append(line)
    text = "\n".join(out)

    if len(text) < 8 or len(text) > 2000:
        return None
    letters = sum(ch.isalpha() for ch in text)
    non_space = sum(not ch.isspace() for ch in text)
    if non_space == 0 or letters / non_space < 0.7:  # ASCII art, code, tables
        return None
    return text


def load_fortunes(fortunes_dir: Path) -> list[tuple[str, str]]:
    """Read every fortune file under ``fortunes_dir``; return (category, text) pairs."""
    if not fortunes_dir.is_dir():
        sys.exit(
            f"error: corpus directory {fortunes_dir} not found.\n"
            "Install Debian's fortune cookie texts first:\n"
            "    apt-get update && apt-get install -y fortunes\n"
            "(or pass --fortunes-dir pointing at a folder of '%'-separated fortune files)."
        )
    entries: list[tuple[str, str]] = []
    for path in sorted(fortunes_dir.iterdir()):
        # Data files have no extension; skip *.dat indexes, *.u8 symlinks, etc.
        if "." in path.name or path.is_symlink() or not path.is_file():
            continue
        if path.name in EXCLUDED_FORTUNE_FILES:
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for chunk in re.split(r"^%\s*$", raw, flags=re.MULTILINE):
            text = clean_fortune(chunk)
            if text is not None:
                entries.append((path.name, text))
    if len(entries) < 1000:
        sys.exit(
            f"error: only {len(entries)} fortunes found under {fortunes_dir}; the corpus "
            "looks incomplete.\nInstall it with: apt-get update && apt-get install -y fortunes"
        )
    return entries


# --------------------------------------------------------------------------
# Chat samples
# --------------------------------------------------------------------------

GENERIC_REQUESTS = [
    "Tell me a quote.",
    "Give me a quote.",
    "Tell me a fortune.",
    "Give me a fortune cookie.",
    "Say something wise.",
    "Tell me something interesting.",
    "Share a famous saying.",
    "Write a sentence.",
    "Tell me a joke.",
    "Can you tell me a quote?",
    "I need some wisdom.",
    "Say something.",
    "What is your favourite quote?",
    "Please share a fortune with me.",
]

TOPIC_NAMES = {
    "computers": "computers",
    "linux": "Linux",
    "linuxcookie": "Linux",
    "love": "love",
    "food": "food",
    "science": "science",
    "work": "work",
    "law": "the law",
    "education": "education",
    "politics": "politics",
    "medicine": "medicine",
    "sports": "sports",
    "kids": "kids",
    "pets": "pets",
    "literature": "literature",
    "wisdom": "wisdom",
    "people": "people",
    "men-women": "men and women",
    "art": "art",
    "startrek": "Star Trek",
    "pratchett": "Discworld",
    "magic": "magic",
    "news": "the news",
    "drugs": "drugs",
    "definitions": "words",
    "debian": "Debian",
    "perl": "Perl",
}

TOPIC_REQUESTS = [
    "Tell me a quote about {topic}.",
    "Give me a fortune about {topic}.",
    "Say something about {topic}.",
    "What do you know about {topic}?",
]

FIXED_EXCHANGES = [
    ("Hello!", "Hello! Would you like to hear a fortune?"),
    ("Hi", "Hi there! Ask me for a quote."),
    ("Who are you?", "I am a tiny language model trained on fortune cookies."),
    ("What are you?", "I am a small Qwen3 model. I know a lot of quotes and jokes."),
    ("What can you do?", "I can tell you a quote, a joke or a fortune."),
    ("Thank you!", "You are welcome."),
    ("Thanks.", "You are welcome. Come back for another fortune."),
    ("Goodbye!", "Goodbye! May your fortune be a good one."),
]

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a fortune teller."]


def chatml(messages: list[tuple[str, str]]) -> str:
    """Render (role, content) messages exactly as CHAT_TEMPLATE does."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def make_chat_sample(rng: random.Random, category: str, text: str) -> str:
    """Build one ChatML conversation whose assistant reply is ``text`` (usually)."""
    messages: list[tuple[str, str]] = []
    if rng.random() < 0.3:
        messages.append(("system", rng.choice(SYSTEM_PROMPTS)))
    roll = rng.random()
    if roll < 0.08:
        user, reply = rng.choice(FIXED_EXCHANGES)
        messages += [("user", user), ("assistant", reply)]
    elif roll < 0.4 and category in TOPIC_NAMES:
        user = rng.choice(TOPIC_REQUESTS).format(topic=TOPIC_NAMES[category])
        messages += [("user", user), ("assistant", text)]
    else:
        messages += [("user", rng.choice(GENERIC_REQUESTS)), ("assistant", text)]
    return chatml(messages)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a lossless byte-level BPE tokenizer (Qwen2-style pre-tokenization)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, f"{tok} should have id {i}"
    return tokenizer


def check_round_trip(tokenizer: Tokenizer) -> None:
    """Fail loudly if decode(encode(text)) is not the identity."""
    samples = [
        "The meaning of life is 42.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Unicode: naïve café, Straße, Ελληνικά, 日本語, emoji 🙂🚀, math ∑√∞.",
        f"{IM_START}user\nHi{IM_END}\n{IM_START}assistant\n",
    ]
    for text in samples:
        ids = tokenizer.encode(text).ids
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise RuntimeError(f"tokenizer round-trip failed: {text!r} -> {back!r}")


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json that AutoTokenizer can load."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added_tokens_decoder = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------
# Data packing
# --------------------------------------------------------------------------


def pack_documents(
    tokenizer: Tokenizer, documents: list[str], seq_len: int
) -> torch.Tensor:
    """Tokenise documents, join them with <|endoftext|>, cut into [N, seq_len] rows."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    stream: list[int] = []
    for enc in tokenizer.encode_batch(documents):
        stream.extend(enc.ids)
        stream.append(eot)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def make_epoch(
    tokenizer: Tokenizer,
    entries: list[tuple[str, str]],
    settings: TrainSettings,
    rng: random.Random,
) -> torch.Tensor:
    """Build one shuffled epoch of packed rows: plain fortunes plus ChatML samples."""
    docs: list[str] = []
    for category, text in entries:
        if rng.random() < settings.chat_fraction:
            docs.append(make_chat_sample(rng, category, text))
        else:
            docs.append(text)
    rng.shuffle(docs)
    rows = pack_documents(tokenizer, docs, settings.seq_len)
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return rows[perm]


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------


def build_model(settings: TrainSettings, vocab_size: int) -> "torch.nn.Module":
    """Create a randomly initialised float32 Qwen3ForCausalLM."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        head_dim=settings.head_dim,
        hidden_act="silu",
        max_position_embeddings=settings.max_position_embeddings,
        rms_norm_eps=settings.rms_norm_eps,
        rope_theta=settings.rope_theta,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        max_window_layers=settings.num_layers,
        bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
    )
    torch.manual_seed(settings.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    return model


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup followed by cosine decay to ``min_lr_ratio * lr``."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return settings.lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model: "torch.nn.Module", rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over ``rows``."""
    model.eval()
    losses: list[float] = []
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i : i + batch_size]
        losses.append(model(input_ids=batch, labels=batch).loss.item() * batch.shape[0])
    model.train()
    return sum(losses) / max(1, rows.shape[0])


def train(
    model: "torch.nn.Module",
    tokenizer: Tokenizer,
    train_entries: list[tuple[str, str]],
    settings: TrainSettings,
) -> tuple[float, float, int]:
    """Train in place; return (final smoothed loss, seconds spent, steps done)."""
    rng = random.Random(settings.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    rows = make_epoch(tokenizer, train_entries, settings, rng)
    print(f"epoch rows: {rows.shape[0]} x {settings.seq_len} tokens", flush=True)
    cursor, epoch = 0, 0
    smoothed = float("nan")
    start = time.monotonic()
    step = 0
    for step in range(settings.steps):
        if cursor + settings.batch_size > rows.shape[0]:
            epoch += 1
            rows = make_epoch(tokenizer, train_entries, settings, rng)
            cursor = 0
            print(f"-- starting epoch {epoch}", flush=True)
        batch = rows[cursor : cursor + settings.batch_size]
        cursor += settings.batch_size

        lr = lr_at(step, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()

        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        elapsed = time.monotonic() - start
        if step % settings.log_every == 0 or step == settings.steps - 1:
            tok_s = (step + 1) * settings.batch_size * settings.seq_len / elapsed
            print(
                f"step {step:4d}/{settings.steps}  loss {value:.4f}  avg {smoothed:.4f}  "
                f"lr {lr:.2e}  gnorm {float(grad_norm):.2f}  {elapsed:6.0f}s  {tok_s:.0f} tok/s",
                flush=True,
            )
        if elapsed > settings.max_minutes * 60:
            print(f"warning: time limit of {settings.max_minutes} min reached, stopping at step {step}")
            break
    return smoothed, time.monotonic() - start, step + 1


# --------------------------------------------------------------------------
# Saving and checking
# --------------------------------------------------------------------------


def save_checkpoint(model: "torch.nn.Module", tokenizer: Tokenizer, out_dir: Path, settings: TrainSettings) -> None:
    """Write the model and tokenizer to ``out_dir``, removing stale or extra files."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in out_dir.iterdir():  # stale artefacts of previous runs
        if path.is_file() and (path.name in OUTPUT_FILES or path.suffix in {".json", ".safetensors", ".bin", ".jinja", ".txt"}):
            path.unlink()

    eot, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    model.generation_config = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=[im_end, eot],
        pad_token_id=eot,
        do_sample=False,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    write_tokenizer_files(tokenizer, out_dir, settings.max_position_embeddings)

    # Extra keys for readers that expect the transformers 4.x field names.
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config.setdefault("rope_theta", settings.rope_theta)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    for path in out_dir.iterdir():
        if path.name not in OUTPUT_FILES:
            if path.is_file():
                path.unlink()
            else:
                print(f"warning: unexpected entry left in {out_dir}: {path.name}")


def verify_checkpoint(out_dir: Path) -> None:
    """Reload with the Auto* classes, check the files, print a few greedy generations."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert "lm_head.weight" not in keys, "tied lm_head.weight must not be stored"
    total = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"checkpoint folder: {total / 1e6:.2f} MB, files: {sorted(p.name for p in out_dir.iterdir())}")
    assert total <= MAX_FOLDER_BYTES, "checkpoint folder exceeds 16 MB"

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir))
    model.eval()
    text = "Round-trip: naïve café, 日本語, 🙂."
    assert tok.decode(tok(text)["input_ids"]) == text, "AutoTokenizer round-trip failed"

    prompts = ["The meaning of life is", "A friend is", "Computers are"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a quote."}], tokenize=False, add_generation_prompt=True
    )
    for prompt in prompts + [chat]:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=30, do_sample=False)
        gen = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=False)
        print(f"--- prompt: {prompt!r}\n    output: {gen!r}", flush=True)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fortunes-dir", type=Path, default=DEFAULT_FORTUNES_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--max-minutes", type=float, default=TrainSettings.max_minutes)
    parser.add_argument("--seed", type=int, default=TrainSettings.seed)
    parser.add_argument("--no-verify", action="store_true", help="skip the reload / generation check")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    settings = TrainSettings(
        steps=args.steps,
        max_minutes=args.max_minutes,
        seed=args.seed,
        warmup_steps=min(TrainSettings.warmup_steps, max(1, args.steps // 10)),
    )
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    t0 = time.monotonic()

    entries = load_fortunes(args.fortunes_dir)
    n_chars = sum(len(t) for _, t in entries)
    print(f"corpus: {len(entries)} fortunes, {n_chars / 1e6:.2f} M characters from {args.fortunes_dir}")
    split_rng = random.Random(settings.seed)
    shuffled = entries[:]
    split_rng.shuffle(shuffled)
    n_val = max(1, int(len(shuffled) * settings.val_fraction))
    val_entries, train_entries = shuffled[:n_val], shuffled[n_val:]

    tokenizer = train_tokenizer([t for _, t in train_entries], settings.vocab_size)
    check_round_trip(tokenizer)
    train_texts = [t for _, t in train_entries]
    n_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(train_texts))
    n_train_chars = sum(len(t) for t in train_texts)
    print(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, train split {len(train_texts)} fortunes, "
        f"{n_tokens} tokens ({n_train_chars / max(1, n_tokens):.2f} chars/token), "
        f"{time.monotonic() - t0:.0f}s"
    )

    model = build_model(settings, tokenizer.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3ForCausalLM, {n_params} parameters ({n_params * 4 / 1e6:.1f} MB in float32)")

    val_rows = pack_documents(tokenizer, [t for _, t in val_entries], settings.seq_len)
    final_loss, seconds, steps_done = train(model, tokenizer, train_entries, settings)
    val_loss = evaluate(model, val_rows, settings.batch_size)
    print(
        f"training done: {steps_done} steps in {seconds / 60:.1f} min, final train loss "
        f"{final_loss:.4f} (smoothed), held-out loss {val_loss:.4f}"
    )

    save_checkpoint(model, tokenizer, args.out, settings)
    print(f"saved to {args.out}")
    if not args.no_verify:
        verify_checkpoint(args.out)
    print(f"total wall time {(time.monotonic() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
