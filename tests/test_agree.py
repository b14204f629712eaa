"""Processes agree on stop/save/spike/hold through the coordination service's key-value store, not a
device collective: two real jax.distributed processes raise different flags, at the same step and at
different steps, and both act on the OR of everyone's flags at the same step, agree.LAG steps later; a
one-shot request that stays raised until served is served once."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, child_env

from trainer.parallel import agree
from trainer.supervise.launcher import free_port

SCRIPT = """
import json, sys
import jax
me, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=me)
import dataclasses
from trainer.parallel.agree import Agreement, one_shot
@dataclasses.dataclass(frozen=True)
class F:
    stop: bool = False
    save: bool = one_shot()
    spike: bool = False
a = Agreement(F, processes=2, start=10)
out = {}
for step in range(11, 23):
    stop = me == 1 and step >= 14          # a level: SIGTERM on process 1 at step 14
    save = me == 0 and 14 <= step <= 16    # a one-shot request, raised until served, with process 1's stop
    spike = me == 1 and step == 19         # raised once
    got = a.exchange(step, F(stop=stop, save=save, spike=spike))
    out[step] = [got.stop, got.save, got.spike]
print(json.dumps(out))
"""


def test_two_processes_act_on_the_same_flags_at_the_same_step(tmp_path):
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(i), port],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    lag = agree.LAG
    acted = {int(k): v for k, v in outs[0].items()}
    assert [s for s, v in acted.items() if v[0]] == [s for s in range(14 + lag, 23)]  # stop from 14 + LAG on
    # Step 14: each process raised another flag; everyone acts on both (the OR, not the AND, of the group).
    assert [s for s, v in acted.items() if v[1]] == [14 + lag]  # the save request: served once
    assert [s for s, v in acted.items() if v[2]] == [19 + lag]
    assert not any(any(v) for s, v in acted.items() if s <= 10 + lag)  # nothing to act on yet after a start
