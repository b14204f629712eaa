"""Tokenizer specs: `bytes` (ids 0..255, 256 separates documents), `bpe:N` (a byte-level BPE trained on
the input with Hugging Face `tokenizers`), a path to a `tokenizer.json`, or a tiktoken encoding name whose
file is already cached locally. Nothing here downloads anything.

A `Tok` is what the preparation pipeline needs: vocab size, end-of-text id, encode(), the file saved
next to the shards, and a picklable payload from which worker processes rebuild it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.config import ConfigError
from trainer.store import env_vars

EOT = "<|endoftext|>"
# End-of-text tokens a tokenizer.json may carry, in the order they are looked for.
EOS_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
BYTES_VOCAB = 257
HF_FILE = "tokenizer.json"  # a Hugging Face tokenizer, saved beside the shards of a prepared DIR
IMPORTED = "imported tokens"  # meta.json's tokenizer for `prepare --from-tokens`: there is none to load
SPEC_FORMS = "bytes, bpe:N (N >= 258), a path to a tokenizer.json, or a tiktoken encoding name (tiktoken:NAME)"


@dataclass(frozen=True)
class Tok:
    name: str  # recorded in meta.json: bytes | bpe:N | tokenizer.json sha256:... | tiktoken:NAME
    kind: str  # bytes | hf | tiktoken
    payload: str  # hf: the tokenizer JSON; tiktoken: the encoding name; bytes: ""
    vocab_size: int
    eos_id: int

    @property
    def file(self) -> str | None:
        """The tokenizer file written into a prepared DIR (None: nothing to save)."""
        return HF_FILE if self.kind == "hf" else None

    def save(self, out: Path) -> None:
        if self.kind == "hf":
            (out / HF_FILE).write_text(self.payload)

    def encoder(self):
        """A callable doc (str | bytes) -> token ids (np.ndarray, without the end-of-text id)."""
        if self.kind == "bytes":
            return lambda doc: np.frombuffer(doc.encode() if isinstance(doc, str) else doc, np.uint8)
        if self.kind == "hf":
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.payload)
            # The post-processor's BOS/EOS are left out: documents end with our own end-of-text id.
            return lambda doc: np.asarray(tok.encode(_text(doc), add_special_tokens=False).ids, np.uint32)
        enc = tiktoken_encoding(self.payload)
        return lambda doc: np.asarray(enc.encode_ordinary(_text(doc)), np.uint32)

    def decoder(self):
        """A callable token ids -> text. Ids the tokenizer does not know (a model's padded vocabulary) are
        left out; bytes that do not form UTF-8 become U+FFFD."""
        if self.kind == "bytes":
            return lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace")
        known = lambda ids: [int(i) for i in ids if 0 <= i < self.vocab_size]  # noqa: E731
        if self.kind == "hf":
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.payload)
            return lambda ids: tok.decode(known(ids), skip_special_tokens=False)
        enc = tiktoken_encoding(self.payload)
        return lambda ids: enc.decode(known(ids))


def _text(doc: str | bytes) -> str:
    return doc if isinstance(doc, str) else doc.decode(errors="replace")


BYTES = Tok("bytes", "bytes", "", BYTES_VOCAB, 256)


def of_prepared(name: str, hf_file: Path | None) -> Tok:
    """The tokenizer a prepared DIR was tokenized with: meta.json's `tokenizer` and its tokenizer.json if any."""
    if hf_file is not None:
        return from_tokenizer_json(hf_file)
    if name == BYTES.name:
        return BYTES
    if name.startswith("tiktoken:"):
        return resolve(name)
    raise ConfigError(f"tokenizer {name!r}: its {HF_FILE} is missing from the prepared data; prepare it again")


def bpe_size(spec: str) -> int | None:
    """N of a `bpe:N` spec, None for other specs; a malformed one is a ConfigError."""
    if not spec.startswith("bpe:"):
        return None
    m = re.fullmatch(r"bpe:(\d+)", spec)
    if not m or int(m.group(1)) < 258:
        raise ConfigError(
            f"tokenizer {spec!r}: bpe:N needs a whole N >= 258 (256 bytes + end-of-text + merges), e.g. bpe:1024"
        )
    return int(m.group(1))


def identity(spec: str) -> str:
    """What names the tokenizer for the cache key: the spec, or a tokenizer file's content hash."""
    if spec == "bytes" or bpe_size(spec):
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return "tokenizer.json sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return "tiktoken:" + _tiktoken_name(spec)


def resolve(spec: str) -> Tok:
    """A ready tokenizer for every spec but bpe:N (that one is trained on the input: `train_bpe`)."""
    if spec == "bytes":
        return BYTES
    if bpe_size(spec):
        raise AssertionError("bpe:N is trained on the input: call train_bpe")
    path = Path(spec).expanduser()
    if path.is_file():
        return from_tokenizer_json(path)
    name = _tiktoken_name(spec)
    enc = tiktoken_encoding(name)
    return Tok(f"tiktoken:{name}", "tiktoken", name, enc.n_vocab, enc.eot_token)


def from_tokenizer_json(path: Path) -> Tok:
    from tokenizers import Tokenizer

    try:
        text = path.read_text()
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the library's parse errors are long Rust messages: name the file instead
        raise ConfigError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({str(e)[:120]})") from None
    eos = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    if eos is None:
        raise ConfigError(
            f"tokenizer {path}: no end-of-text token (looked for {', '.join(EOS_NAMES)}); add one as a special token"
        )
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Tok(f"tokenizer.json sha256:{digest[:16]}", "hf", text, tok.get_vocab_size(with_added_tokens=True), eos)


def train_bpe(n: int, docs: Iterable[str | bytes], *, n_docs: int) -> Tok:
    """A byte-level BPE of n tokens (end-of-text first, then the 256 byte symbols, then merges), trained
    offline on `docs`. Deterministic: the same documents give the same tokenizer.json bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n, special_tokens=[EOT], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((_text(d) for d in docs), trainer=trainer, length=n_docs)
    return Tok(f"bpe:{n}", "hf", tok.to_str(), tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(EOT))


# --- tiktoken: only what is already on this machine -------------------------------------------------


class _NoDownload(Exception):
    pass


def _tiktoken_name(spec: str) -> str:
    name = spec.removeprefix("tiktoken:")
    try:
        import tiktoken
    except ImportError:
        raise ConfigError(
            f"tokenizer {spec!r} is not one of {SPEC_FORMS} (as a tiktoken encoding: tiktoken is "
            f"not installed; pip install tiktoken, with its encoding file in {env_vars.TIKTOKEN_CACHE_DIR})"
        ) from None
    if name not in tiktoken.list_encoding_names():
        raise ConfigError(
            f"tokenizer {spec!r} is not one of {SPEC_FORMS} (known tiktoken encodings: "
            f"{', '.join(tiktoken.list_encoding_names())})"
        )
    return name


def tiktoken_encoding(name: str):
    """tiktoken's encoding, read from its local cache only: tiktoken fetches a missing file over the
    network through tiktoken.load.read_file, which is replaced here by a refusal for the duration."""
    import tiktoken
    import tiktoken.load

    def refuse(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _NoDownload(blobpath)
        with open(blobpath, "rb") as fh:
            return fh.read()

    real = tiktoken.load.read_file
    tiktoken.load.read_file = refuse
    try:
        return tiktoken.get_encoding(name)
    except _NoDownload as e:
        cache = (
            os.environ.get(env_vars.TIKTOKEN_CACHE_DIR)
            or os.environ.get(env_vars.DATA_GYM_CACHE_DIR)
            or os.path.join(tempfile.gettempdir(), "data-gym-cache")
        )  # tiktoken.load's own lookup order
        key = hashlib.sha1(str(e).encode()).hexdigest()
        raise ConfigError(
            f"tiktoken encoding {name!r} is not available locally (nothing is downloaded): put "
            f"{e} at {cache}/{key} (or set {env_vars.TIKTOKEN_CACHE_DIR}), or use bpe:N or a tokenizer.json"
        ) from None
    finally:
        tiktoken.load.read_file = real
