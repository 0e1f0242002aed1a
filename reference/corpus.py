"""Build the training corpus and tokenizer of the reference models.

The corpus is the Python source of the CPython standard library (PSF-2.0),
``*.py`` files only, test suite included (it is most of the volume and it is
real, idiomatic Python), ``site-packages`` excluded. It is split BY FILE into
train and held-out with a stable hash of the file's path relative to the
stdlib root (see ``is_heldout``), so a held-out file is never trained on.

Outputs (deterministic for a given stdlib tree):

* ``reference/tokenizer/``: ``tokenizer.json`` (byte-level BPE, vocabulary
  8192, trained on the train split only) and ``tokenizer_config.json`` /
  ``special_tokens_map.json`` that ``transformers.AutoTokenizer`` and
  ``mlx_lm`` load (``PreTrainedTokenizerFast``).
* ``reference/split.json``: the hash rule and the train / held-out file lists.
* ``reference/heldout.txt``: ~300 KB of whole held-out files, joined by
  ``<|endoftext|>``, committed for evaluation.
* ``<scratch>/train.npy``, ``<scratch>/heldout.npy``: uint16 token ids of the
  two splits (files separated by ``<|endoftext|>``), ``<scratch>/heldout_txt.npy``:
  the ids of ``reference/heldout.txt``. Scratch defaults to ``.refdata/`` at the
  repository root (git-ignored through ``.git/info/exclude``).

Run: ``.venv/bin/python reference/corpus.py`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

VOCAB_SIZE = 8192
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]  # ids 0 and 1
HELDOUT_PER_10000 = 200  # 2 % of files
HELDOUT_TXT_BYTES = 300_000
HELDOUT_TXT_MAX_FILE = 60_000  # whole files only; skip huge ones for variety
MAX_FILE_BYTES = 400_000  # drops pydoc_data/topics.py (prose, 750 KB)
# Directories that are not hand-written Python: generated tables, build config.
EXCLUDE_PARTS = {"site-packages", "__pycache__", "pydoc_data", "encodings"}
EXCLUDE_PREFIXES = ("config-", "_sysconfigdata")

# Pre-tokenizer split (the GPT-4 / Llama-3 pattern): newlines are pieces of their own,
# apart from the indentation that follows them, so a prompt that ends in "\n" ends
# at a boundary the model saw in training; digits go in runs of at most three.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

HASH_RULE = (
    "heldout iff int.from_bytes(sha256(relpath.encode('utf-8')).digest()[:8], 'big')"
    f" % 10000 < {HELDOUT_PER_10000}; relpath is POSIX, relative to the stdlib root"
)


def is_heldout(relpath: str) -> bool:
    """Stable by-file split: about 2 % of files are held out."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h % 10000 < HELDOUT_PER_10000


def _order_key(relpath: str) -> bytes:
    """Stable pseudo-random order of files in the token stream."""
    return hashlib.sha256(b"order:" + relpath.encode("utf-8")).digest()


def collect_files(stdlib: Path) -> dict[str, str]:
    """relpath -> text for every kept ``*.py`` file (UTF-8 decodable, not huge)."""
    out: dict[str, str] = {}
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).as_posix()
        parts = rel.split("/")
        if EXCLUDE_PARTS.intersection(parts[:-1]):
            continue
        if parts[0].startswith(EXCLUDE_PREFIXES):
            continue
        if not p.is_file() or p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace("\r\n", "\n")
        if EOS in text or PAD in text or not text.strip():
            continue
        out[rel] = text
    return out


def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1
    return tok


def tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Plain concatenation: these are base models of source code.
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    }


def special_tokens_map() -> dict:
    return {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}


def write_tokenizer_files(tok, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n")


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Token ids of texts, each followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    assert int(arr.max()) < VOCAB_SIZE
    return arr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--scratch", type=Path, default=ROOT / ".refdata")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)

    files = collect_files(args.stdlib)
    train = sorted((r for r in files if not is_heldout(r)), key=_order_key)
    held = sorted((r for r in files if is_heldout(r)), key=_order_key)
    tb = sum(len(files[r].encode()) for r in train)
    hb = sum(len(files[r].encode()) for r in held)
    print(f"files: {len(train)} train ({tb/1e6:.1f} MB), {len(held)} held-out ({hb/1e6:.2f} MB)")

    tok = train_tokenizer([files[r] for r in train])
    write_tokenizer_files(tok, args.out / "tokenizer")

    # Held-out sample: whole held-out files in path order up to ~300 KB.
    sample: list[str] = []
    size = 0
    for r in sorted(held):
        n = len(files[r].encode())
        if n > HELDOUT_TXT_MAX_FILE:
            continue
        if size + n > HELDOUT_TXT_BYTES and size > 0:
            continue
        sample.append(r)
        size += n
    heldout_txt = EOS.join(files[r] for r in sample)
    (args.out / "heldout.txt").write_text(heldout_txt, encoding="utf-8")

    split = {
        "source": f"CPython {sys.version.split()[0]} standard library *.py (PSF-2.0)",
        "stdlib_root": "lib/python3.X relative paths",
        "rule": HASH_RULE,
        "vocab_size": VOCAB_SIZE,
        "train_files": sorted(train),
        "heldout_files": sorted(held),
        "heldout_txt_files": sample,
    }
    (args.out / "split.json").write_text(json.dumps(split, indent=1) + "\n")

    args.scratch.mkdir(parents=True, exist_ok=True)
    tr = encode_stream(tok, [files[r] for r in train])
    he = encode_stream(tok, [files[r] for r in held])
    ht = np.asarray(tok.encode(heldout_txt, add_special_tokens=False).ids, dtype=np.uint16)
    np.save(args.scratch / "train.npy", tr)
    np.save(args.scratch / "heldout.npy", he)
    np.save(args.scratch / "heldout_txt.npy", ht)
    stats = {
        "train_files": len(train),
        "heldout_files": len(held),
        "train_bytes": tb,
        "heldout_bytes": hb,
        "train_tokens": int(tr.size),
        "heldout_tokens": int(he.size),
        "heldout_txt_files": len(sample),
        "heldout_txt_bytes": len(heldout_txt.encode()),
        "heldout_txt_tokens": int(ht.size),
        "bytes_per_token": round(tb / tr.size, 3),
        "train_sha256": hashlib.sha256(tr.tobytes()).hexdigest(),
    }
    (args.scratch / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
