"""``benchmarks/step_records.py`` with the settings of this study, beside speculation off:

- ``adaptive``: the default, whose draft, fed in a step without drafts, replays its graph
  on the target's inputs in steps with prompt chunks (ragged) as well as in decoding ones
  (padded): ``GraphRunner.replay_inputs_of``;
- ``adaptive, padded only``: the same, but a step whose target pass runs a ragged graph
  (a query longer than the draft's graphs take) builds the draft's own inputs, as before
  this study (the default at e057b9d);
- ``adaptive, fed after the pass``: the default, but the draft's feed in a step without
  drafts starts on its stream once the target's pass is done (an event recorded after it
  was queued), not beside it (an event recorded before): it then runs beside the sampler
  and the host's work between the passes rather than taking the device from the target's.

    python share_ab.py [step_records.py's arguments] --settings "off;adaptive;..."
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_records


def padded_only(engine):
    drafter = engine.speculator.drafter
    catch_up = drafter._catch_up_pass

    def catch_up_padded_only(scheduled, entries):
        if max(len(p.token_ids) for p in scheduled) > drafter.runner.graphs.max_query_len:
            drafter._forward(entries)  # a ragged step: the draft's own inputs
            return
        catch_up(scheduled, entries)
    drafter._catch_up_pass = catch_up_padded_only


def fed_after_the_pass(engine):
    import torch

    speculator = engine.speculator
    catch_up = speculator.catch_up

    def catch_up_after_the_pass(drafts):
        if drafts.catch_up is not None and drafts.catch_up[1] is not None:
            done = torch.cuda.Event()
            done.record()  # the target's pass is queued: the feed waits for it
            drafts.catch_up = (drafts.catch_up[0], done)
        catch_up(drafts)
    speculator.catch_up = catch_up_after_the_pass


def counted(engine):
    """The default, its draft's replays on the target's inputs counted by kind of graph
    (printed at exit): whether the ragged ones happen at all."""
    import atexit
    from collections import Counter

    graphs = engine.speculator.drafter.runner.graphs
    if graphs is None:  # (no graphs: a CPU)
        return
    replay, counts = graphs.replay_inputs_of, Counter()

    def replay_counted(other, planned):
        last = other.last_inputs
        done = replay(other, planned)
        counts["ragged" if last is not None and last[0][0] == 0 else "padded", done] += 1
        return done
    graphs.replay_inputs_of = replay_counted
    atexit.register(lambda: print("draft replays on the target's inputs (kind, replayed): count",
                                  dict(counts), flush=True))


for name, setup in (("adaptive", counted), ("adaptive, padded only", padded_only),
                    ("adaptive, fed after the pass", fed_after_the_pass)):
    step_records.SETTINGS.setdefault(name, {})
    step_records.SETUP[name] = setup
sys.exit(step_records.main(sys.argv[1:]))
