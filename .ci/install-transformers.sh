#!/usr/bin/env bash
# For tests/test_export.py's check that Hugging Face's GPT2LMHeadModel reads our export, into the active venv:
# torch's CPU build (this kind of machine keeps the 2.13.0 wheel on disk; an unpinned torch from the index is
# a CUDA build of several GB) and transformers. About 75 s and 1.1 GB on 2 cores. Neither is a dependency of
# the trainer: exporting needs only safetensors.
set -euo pipefail
python -m pip install 'torch==2.13.0' 'transformers>=4.40'
