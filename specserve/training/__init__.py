"""Draft training (``python -m specserve.training``), apart from the runtime: the serving
path never imports it.

- ``data``: prompts, the target's responses to them, the batches training reads;
- ``draft``: a layers-only draft built from the target's layers, warm-started and grown;
- ``eagle_head``: an EAGLE head and its unrolled training passes;
- ``students``: one interface for both (``Student``) and ``make_student``;
- ``losses`` and ``validation``: what a draft learns and how it is scored;
- ``loop``: the training loop; ``runtime``: devices, ranks and the log;
- ``card``: the training record and model card; ``evaluate``: the draft in the engine;
- ``main``: the command.
"""
