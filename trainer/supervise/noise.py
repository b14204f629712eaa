"""Which worker output lines are library noise: kept in the worker log, kept off the user's terminal.

XLA, absl and friends log through the C++/absl logger (`W1201 10:11:31.892929 19922 file.cc:656] ...`); an
info or warning line from them (e.g. "[SPMD] Involuntary full rematerialization") is for whoever debugs the
compiler, not for someone watching a run. Their errors and fatal lines still reach the terminal.
"""

from __future__ import annotations

import re

# severity letter, MMDD, time, thread id, file:line]  (absl / glog format); optional srun-style "3: " label
_ABSL = re.compile(r"^(?:\d+: )?([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")
_BANNERS = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",)


def is_library_noise(line: str) -> bool:
    m = _ABSL.match(line)
    if m:
        return m.group(1) in "IW"  # E(rror) and F(atal) may be why a worker died: the user sees them
    text = line.strip()
    return any(text.endswith(b) for b in _BANNERS)
