"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) that propose from a step's output after
the step, and the engine-side `Speculator` that owns them. The scheduler knows only each row's draft token ids;
acceptance and KV rollback are `Scheduler.update`'s.

  proposer.py     Proposer (the one interface), NgramProposer, make_proposer
  draft_model.py  DraftProposer: a small model of the same tokenizer, its KV in the target's blocks
  draft_kv.py     the draft model's view of the target's blocks (host, no JAX)
  speculator.py   Speculator: which requests speculate, the proposals after each step, acceptance counters
"""
