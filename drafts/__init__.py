"""Drafters, installed as ``specserve.drafts``: one file per drafter behind one protocol
(draft model, n-gram, layer-skip). The engine core already schedules k_i draft tokens per
request (``ScheduledRequest.draft_token_ids``) and rewinds KV past rejected ones."""
