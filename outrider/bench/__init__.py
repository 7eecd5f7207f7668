"""Measuring speculative decoding: ``local`` (our engine against our autoregressive baseline,
same run), ``served`` (an external engine's endpoint and counters: same verb, same record),
``verdict`` (is greedy speculative output the plain greedy output).
"""
