"""`python -m trainer export RUN_DIR --out DIR [--step N]`: a checkpoint as a Hugging Face model directory
(`config.json`, `model.safetensors`, and the tokenizer files when the run used a prepared tokenizer),
readable by `GPT2LMHeadModel.from_pretrained(DIR)` (model.arch gpt2) or `LlamaForCausalLM.from_pretrained(DIR)`
(model.arch llama), and by anything that reads safetensors. No torch is needed to write it.

The conversion (trainer.model.hf) is a renaming, a reshape and a transpose of each param: no arithmetic. The
params are restored on one CPU device without the training mesh (weights.on_cpu), so a checkpoint of any
mesh or process count exports on a laptop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from trainer.ckpt import weights
from trainer.config import ConfigError, ModelConfig
from trainer.corpus.run_tokenizer import RunTokenizer, tokenizer_of
from trainer.model import hf
from trainer.observe import pick
from trainer.store.rundir import write_json
from trainer.train.state import params_sha256

CONFIG, MODEL, TOKENIZER = hf.CONFIG, hf.MODEL, "tokenizer.json"


def _tokenizer_files(tmp: Path, tok: RunTokenizer, cfg: ModelConfig) -> list[str]:
    """The run's tokenizer.json and a tokenizer_config.json that makes it load as a fast tokenizer."""
    if tok.file is None:
        return []
    shutil.copyfile(tok.file, tmp / TOKENIZER)
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tmp / TOKENIZER)).id_to_token(tok.eos_id)
    write_json(
        tmp / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos,
            "bos_token": eos,
            "model_max_length": cfg.seq_len,
        },
    )
    return [TOKENIZER, "tokenizer_config.json"]


def _no_file(tok: RunTokenizer) -> str:
    """What to tell about a tokenizer that has no file to export."""
    if tok.name == "bytes":
        return "; tokenizer bytes has no file: ids 0-255 are UTF-8 bytes, 256 ends a text"
    return f"; tokenizer {tok.name!r} has no file to export (eos id {tok.eos_id})"


def write(out: Path, loaded: weights.Loaded, tok: RunTokenizer) -> list[str]:
    """The model directory, built beside `out` and renamed into place: a failure leaves no partial export."""
    from safetensors.numpy import save_file

    cfg = loaded.model
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Missing parents are made here, after the checkpoint has loaded, so a refused export creates nothing;
    # the temp dir sits beside `out`, on its filesystem, so the rename below is atomic.
    tmp.mkdir(parents=True)
    try:
        write_json(tmp / CONFIG, hf.config_json(cfg, tok.eos_id), indent=2)
        # The provenance rides in the safetensors header (string values); params_sha256 is the one the
        # run's summary.json reports for the same params, however they were sharded.
        save_file(
            hf.tensors(loaded.params, cfg),
            str(tmp / MODEL),
            metadata={
                "format": "pt",
                "trainer_checkpoint": str(loaded.picked.dir.absolute()),
                "trainer_step": str(loaded.picked.step),
                "trainer_params_sha256": params_sha256(loaded.params),
                "trainer_tokenizer": tok.name,
            },
        )
        _sort_metadata(tmp / MODEL)
        files = [CONFIG, MODEL, *_tokenizer_files(tmp, tok, cfg)]
        umask = os.umask(0)
        os.umask(umask)
        for f in files:  # safetensors creates its file private (0600): an export is for others to read
            os.chmod(tmp / f, 0o666 & ~umask)
        os.replace(tmp, out)  # an empty `out` is replaced; anything else was refused before
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def _sort_metadata(path: Path) -> None:
    """safetensors writes the header's __metadata__ from a Rust HashMap, in another order in each process, so two
    exports of one checkpoint would differ in a few header bytes. Rewritten with its keys sorted: the same JSON and
    length (safetensors writes it compact, padded with spaces to 8 bytes), the tensors untouched, and an export
    is a pure function of its checkpoint, byte for byte."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        assert len(text) <= n, (len(text), n)  # the same keys and values: never longer
        f.seek(8)
        f.write(text.ljust(n, b" "))


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; pick a new one (nothing was written)")
    # `out`'s missing parents are created by write() (`--out exports/tiny` on a fresh clone): what must be
    # writable is the nearest ancestor that exists.
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {parent} is not a writable directory; pick another --out")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir (or one checkpoint: RUN_DIR/checkpoints/STEP)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the model directory to create (new or empty; missing parents are created)",
    )
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="export this checkpoint (default: the newest that "
        "verifies); needed while the run still trains, and it must be sealed",
    )
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # never the training devices: a laptop exports too
    try:
        out = Path(args.out)
        _check_out(out)
        picked = pick.pick(args.run_dir, args.step)
        loaded = weights.on_cpu(picked)
        tok = tokenizer_of(picked.run_dir, loaded.meta)
        files = write(out, loaded, tok)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in picked.notes:
        print(f"note: {note}", file=sys.stderr)
    check = "verified" if picked.verified else "UNVERIFIED (saved without content manifests)"
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(loaded.params))
    print(
        f"exported step {picked.step} of {picked.dir} ({check}, {n / 1e6:.3g}M params) to {out}: {', '.join(files)}"
        + ("" if tok.file else _no_file(tok))
    )
    return 0
