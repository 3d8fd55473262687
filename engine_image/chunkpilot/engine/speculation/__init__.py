"""Speculative decoding's drafting, beside the scheduler rather than inside it (as vLLM v1's spec_decode): the
proposers (n-gram, draft model), the draft model's engine, and a draft's cost. The engine has the proposer draft
after each step and hands the ids to the scheduler, which only budgets them. Beside execution, neither importing
the other; below the engine.

Empty on purpose: importing one module of the layer never loads its siblings."""
