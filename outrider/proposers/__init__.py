"""Draft proposers behind one small protocol (``base.Proposer``): n-gram, draft model, EAGLE-3."""
